"""The sampler with ``batch_invariant=True`` where Triton runs (the fused last pass; here under
Triton's interpreter on a platform made to say it has Triton): a row's token and logprob do not
change when another row of the batch asks for top tokens, or when the row runs alone, and every
logprob it reports (the chosen token's, the top tokens', the prompt logprobs' ``log_softmax``)
comes from one logsumexp, to the bit."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton", reason="the fused sampling pass needs the triton package")

from pagedllm.sample import sampler as sampler_module
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")


@pytest.fixture
def sampler(monkeypatch: pytest.MonkeyPatch) -> Sampler:
    platform = sampler_module.platform_for(DEVICE)
    monkeypatch.setattr(
        sampler_module, "platform_for", lambda device: dataclasses.replace(platform, triton=True)
    )
    return Sampler(DEVICE, batch_invariant=True)


def _metadata(num_rows: int, *, greedy: bool, top: int) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=None if greedy else torch.full((num_rows,), 0.8, device=DEVICE),
        greedy=None if greedy else torch.zeros(num_rows, dtype=torch.bool, device=DEVICE),
        all_greedy=greedy,
        max_num_top_tokens=top,
    )


def _logits(num_rows: int, vocab: int) -> torch.Tensor:
    # One token far above a long tail: a logsumexp near 0 shows the tail's summation order.
    generator = torch.Generator().manual_seed(vocab)
    logits = -12 + 2 * torch.randn((num_rows, vocab), generator=generator)
    logits[:, 11] = 0.0
    return logits.to(DEVICE)


@pytest.mark.parametrize("greedy", [True, False])
def test_top_tokens_in_the_batch_change_no_row(sampler: Sampler, greedy: bool) -> None:
    logits = _logits(40, 9000)
    torch.manual_seed(0)  # the same Exp(1) noise for both draws
    plain = sampler(logits.clone(), _metadata(40, greedy=greedy, top=0))
    torch.manual_seed(0)
    with_top = sampler(logits.clone(), _metadata(40, greedy=greedy, top=3))
    assert torch.equal(plain.token_ids, with_top.token_ids)
    assert torch.equal(plain.logprobs, with_top.logprobs)
    every = sampler.log_softmax(logits)
    assert torch.equal(every.gather(-1, plain.token_ids[:, None]).squeeze(-1), plain.logprobs)
    assert torch.equal(with_top.top_logprobs, every.topk(3, dim=-1).values)
    assert torch.equal(with_top.ranks, (every > plain.logprobs[:, None]).sum(dim=-1) + 1)
    torch.testing.assert_close(every, torch.log_softmax(logits, dim=-1))


def test_a_row_alone_equals_its_row_in_the_batch(sampler: Sampler) -> None:
    logits = _logits(40, 20_000)
    batch = sampler(logits.clone(), _metadata(40, greedy=True, top=0))
    for row in (0, 39):
        alone = sampler(logits[row : row + 1].clone(), _metadata(1, greedy=True, top=0))
        assert torch.equal(alone.token_ids, batch.token_ids[row : row + 1])
        assert torch.equal(alone.logprobs, batch.logprobs[row : row + 1])
        assert torch.equal(
            sampler.log_softmax(logits[row : row + 1]), sampler.log_softmax(logits)[row : row + 1]
        )
