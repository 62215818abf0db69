"""The sampler on CUDA, where its last pass is the fused Triton kernel, against the same sampler
on the CPU (the torch path): greedy tokens and logprobs equal with bans and penalties; sampled
rows follow the distribution, stay inside top-k / min-p, and a seeded row ignores its batch."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
VOCAB = 151_936  # Qwen3's: many chunks per row


def _metadata(temperatures: list[float], device: str, **extra) -> SamplingMetadata:
    greedy = torch.tensor([t == 0.0 for t in temperatures], device=device)
    return SamplingMetadata(
        temperature=torch.tensor([t or 1.0 for t in temperatures], device=device),
        greedy=greedy,
        all_greedy=bool(greedy.all()),
        **extra,
    )


@pytest.mark.parametrize("num_rows", [1, 7, 256])
def test_greedy_with_bans_and_penalties_equals_the_cpu(num_rows):
    generator = torch.Generator().manual_seed(num_rows)
    logits = 3 * torch.randn((num_rows, VOCAB), generator=generator)
    counts = (torch.rand((num_rows, VOCAB), generator=generator) < 1e-3).float()
    rows = torch.arange(num_rows)

    def run(device: str):
        metadata = _metadata(
            [0.0] * num_rows,
            device,
            presence_penalty=torch.full((num_rows,), 0.5, device=device),
            frequency_penalty=torch.full((num_rows,), 0.25, device=device),
            repetition_penalty=torch.ones(num_rows, device=device),
            output_counts=counts.to(device),
            banned_rows=rows.to(device),
            banned_token_ids=logits.argmax(-1).to(device),  # each row's favourite, banned
        )
        return Sampler(device)(logits.to(device), metadata)

    cpu, cuda = run("cpu"), run("cuda")
    assert cuda.token_ids.cpu().tolist() == cpu.token_ids.tolist()
    # log_softmax on either device rounds differently in the last bits.
    torch.testing.assert_close(cuda.logprobs.cpu(), cpu.logprobs, rtol=1e-5, atol=1e-4)


def test_sampled_rows_follow_the_distribution_and_truncation():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.full((4000, VOCAB), -30.0)
    logits[:, :4] = probs.log()
    metadata = _metadata([1.0] * 4000, "cuda")
    counts = torch.bincount(Sampler("cuda")(logits.cuda(), metadata).token_ids.cpu(), minlength=4)[:4]
    assert torch.allclose(counts.float() / 4000, probs, atol=0.03)
    # min_p 0.2 (threshold 0.1) leaves tokens 0-2; top-k 2 leaves tokens 0-1.
    for extra, allowed in (({"min_p": torch.full((4000,), 0.2)}, 3), ({"top_k": torch.full((4000,), 2)}, 2)):
        metadata = _metadata([1.0] * 4000, "cuda", **{k: v.cuda() for k, v in extra.items()})
        tokens = Sampler("cuda")(logits.cuda(), metadata).token_ids
        assert int(tokens.max()) < allowed and len(tokens.unique()) == allowed


def test_a_seeded_row_does_not_depend_on_the_batch():
    logits = torch.randn((4, VOCAB), device="cuda")
    sampler = Sampler("cuda")
    alone = sampler(logits[2:3].clone(), _metadata([1.0], "cuda", generators={0: _generator(7)}))
    torch.manual_seed(123)
    mixed = sampler(logits.clone(), _metadata([1.0, 0.0, 1.0, 0.5], "cuda", generators={2: _generator(7)}))
    assert alone.token_ids[0].item() == mixed.token_ids[2].item()
    assert mixed.token_ids[1].item() == logits[1].argmax().item()


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)
