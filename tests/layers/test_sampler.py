"""The sampler against direct computations of each option's distribution."""

import pytest
import torch

from pagedllm.sample import sampler as sampler_module
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, apply_min_p, apply_top_k_top_p
from pagedllm.structured_output import allocate_token_bitmask

VOCAB = 50


def metadata(temperatures: list[float], generators=None, banned=None) -> SamplingMetadata:
    """Rows with these temperatures (0 = greedy); ``generators``: row -> generator; ``banned``:
    (rows, token ids) under min_tokens."""
    greedy = torch.tensor([t == 0.0 for t in temperatures])
    result = SamplingMetadata(
        temperature=torch.tensor([t if t else 1.0 for t in temperatures]),
        greedy=greedy,
        all_greedy=bool(greedy.all()),
        generators=generators or {},
    )
    if banned is not None:
        result.banned_rows, result.banned_token_ids = (torch.tensor(x) for x in banned)
    return result


def test_greedy_takes_the_argmax_and_reports_its_logprob():
    logits = torch.randn(3, VOCAB)
    out = Sampler()(logits.clone(), metadata([0.0] * 3))
    expected = logits.argmax(-1)
    logprobs = torch.log_softmax(logits, -1)
    assert out.token_ids.tolist() == expected.tolist()
    for i in range(3):
        assert abs(out.logprobs[i].item() - logprobs[i, expected[i]].item()) < 1e-6


def test_top_tokens_and_ranks_when_asked():
    logits = torch.randn(3, VOCAB)
    m = metadata([0.0] * 3)
    m.max_num_top_tokens = 4
    out = Sampler()(logits.clone(), m)
    logprobs = torch.log_softmax(logits, -1)
    values, ids = logprobs.topk(4, dim=-1)
    assert out.top_token_ids.tolist() == ids.tolist()
    torch.testing.assert_close(out.top_logprobs, values)
    assert out.ranks.tolist() == [1, 1, 1]  # greedy picks the most likely token


def test_top_k_top_p_keep_exactly_the_expected_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0], [5.0, 4.0, 0.0, 0.0, 0.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([2, 5]), None)
    assert torch.isfinite(masked[0]).tolist() == [False, True, False, True, False]
    assert torch.isfinite(masked[1]).all()
    probs = torch.softmax(logits[1], -1)
    # top_p=0.7: 5.0 has ~0.72 of the mass alone; the nucleus is that token only.
    assert probs[0] > 0.7
    masked = apply_top_k_top_p(logits, None, torch.tensor([1.0, 0.7]))
    assert torch.isfinite(masked[1]).tolist() == [True, False, False, False, False]
    assert torch.isfinite(masked[0]).all()


def test_min_p_masks_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    kept = apply_min_p(logits, torch.tensor([0.2, 0.0]))  # row 0: below 0.1 goes; row 1: none
    assert torch.isfinite(kept).tolist() == [[True, True, True, False], [True] * 4]
    assert torch.equal(kept[0, :3], logits[0, :3])


def test_random_sampling_follows_the_distribution():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-9]]))
    num_rows = 4000
    out = Sampler()(logits.expand(num_rows, -1).clone(), metadata([1.0] * num_rows))
    counts = torch.bincount(out.token_ids, minlength=4).float() / num_rows
    assert torch.allclose(counts, torch.tensor([0.6, 0.3, 0.1, 0.0]), atol=0.03)


def test_tokens_of_probability_zero_are_never_drawn():
    """The CPU's inverse-CDF draw skips a -inf token wherever it sits (first, between two kept
    ones, last) and lands on the kept ones in proportion, seeded rows and greedy rows included."""
    torch.manual_seed(1)
    row = torch.full((VOCAB,), float("-inf"))
    row[[1, 2, VOCAB // 2]] = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    num_rows = 3000
    generators = {i: torch.Generator().manual_seed(i) for i in range(0, num_rows, 7)}
    temperatures = [0.0 if i % 11 == 5 else 1.0 for i in range(num_rows)]
    out = Sampler()(row.expand(num_rows, -1).clone(), metadata(temperatures, generators))
    assert set(out.token_ids.tolist()) <= {1, 2, VOCAB // 2}
    greedy = torch.tensor(temperatures) == 0
    assert (out.token_ids[greedy] == 2).all()
    counts = torch.bincount(out.token_ids[~greedy], minlength=VOCAB)[[1, 2, VOCAB // 2]].float()
    assert torch.allclose(counts / counts.sum(), torch.tensor([0.2, 0.5, 0.3]), atol=0.04)


def test_temperature_sharpens():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.6, 0.4]])).expand(2000, -1).clone()
    out = Sampler()(logits, metadata([0.25] * 2000))
    share = (out.token_ids == 0).sum().item() / 2000
    expected = 0.6**4 / (0.6**4 + 0.4**4)  # p^(1/T), renormalised
    assert abs(share - expected) < 0.03


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(4, VOCAB)
    alone = Sampler()(logits[2:3].clone(), metadata([1.0], {0: torch.Generator().manual_seed(7)}))
    torch.manual_seed(123)
    mixed = Sampler()(logits.clone(), metadata([1.0, 1.0, 1.0, 0.5], {2: torch.Generator().manual_seed(7)}))
    assert alone.token_ids[0].item() == mixed.token_ids[2].item()


def test_min_tokens_bans_stop_tokens_until_reached():
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 10.0  # token 3 (EOS) is by far the most likely
    # Row 0 is under min_tokens (its stop token 3 is banned); row 1 has reached it.
    out = Sampler()(logits, metadata([0.0, 0.0], banned=([0], [3])))
    assert out.token_ids[0].item() != 3
    assert out.token_ids[1].item() == 3


@pytest.mark.parametrize("temperatures", [[0.0] * 5, [0.0, 1.0, 0.7, 1.0, 0.0]])
@pytest.mark.parametrize("edits", ["none", "bans", "penalties", "bitmask"])
def test_the_cpu_kernel_pass_and_the_torch_pass_draw_the_same(monkeypatch, temperatures, edits):
    """The CPU's pass is chosen when the sampler is built: with pagedllm's kernels (each row's
    argmax and log-sum-exp) or torch's log_softmax. Both draw the same tokens and report the
    raw logits' logprobs of them, greedy or sampled, with bans, penalties or a grammar bitmask."""
    if not sampler_module.cpu_kernels_available():
        pytest.skip("pagedllm's CPU kernels do not build here")
    with_kernels = Sampler("cpu")
    monkeypatch.setattr(sampler_module, "cpu_kernels_available", lambda: False)
    torch_only = Sampler("cpu")
    assert with_kernels._sample != with_kernels._torch_pass and torch_only._sample == torch_only._torch_pass
    logits = 3 * torch.randn(len(temperatures), VOCAB, generator=torch.Generator().manual_seed(5))
    bitmask = None
    if edits == "bitmask":
        bitmask = allocate_token_bitmask(len(temperatures), VOCAB)
        bitmask[:, 0] = 0x0F0F0F0F  # tokens 0-3, 8-11, 16-19 and 24-27 only
        bitmask[:, 1:] = 0
    outputs = []
    for sampler in (with_kernels, torch_only):
        banned = ([0, 1, 2], [int(logits[i].argmax()) for i in range(3)]) if edits == "bans" else None
        m = metadata(temperatures, banned=banned)
        if edits == "penalties":
            m.presence_penalty = torch.full((len(temperatures),), 0.5)
            m.frequency_penalty = torch.full((len(temperatures),), 0.25)
            m.output_counts = (logits > 2).float()
        torch.manual_seed(9)
        outputs.append(sampler(logits.clone(), m, bitmask))
    kernels, reference = outputs
    assert kernels.token_ids.tolist() == reference.token_ids.tolist()
    torch.testing.assert_close(kernels.logprobs, reference.logprobs, rtol=0, atol=1e-5)
    if edits == "bitmask":
        assert all(t < 4 or 8 <= t < 12 or 16 <= t < 20 or 24 <= t < 28 for t in kernels.token_ids.tolist())
