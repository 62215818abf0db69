"""The rejection sampler against a naive one-request-at-a-time reference (Leviathan et al. 2023,
point-mass drafts), and its output distribution against the target's."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample.rejection_sampler import draft_row_index, rejection_sample


def naive_rejection_sample(
    drafts: list[list[int]],
    argmax: torch.Tensor,
    probs: torch.Tensor | None,
    greedy: list[bool],
    uniform: torch.Tensor | None,
) -> list[list[int]]:
    """Request by request, draft by draft, as the papers write it."""
    outputs = []
    row = 0
    for i, request_drafts in enumerate(drafts):
        emitted: list[int] = []
        for j, draft in enumerate([*request_drafts, None]):
            r = row + j
            if draft is None:  # every draft accepted: the bonus token
                token = int(argmax[r]) if greedy[i] else _inverse_cdf(probs[r], float(uniform[i, -1]))
                emitted.append(token)
                break
            if greedy[i]:
                accept = draft == int(argmax[r])
            else:
                accept = float(uniform[i, j]) < float(probs[r, draft])
            if accept:
                emitted.append(draft)
                continue
            if greedy[i]:
                emitted.append(int(argmax[r]))
            else:
                residual = probs[r].clone()
                residual[draft] = 0.0
                emitted.append(_inverse_cdf(residual / residual.sum(), float(uniform[i, -1])))
            break
        outputs.append(emitted)
        row += len(request_drafts) + 1
    return outputs


def _inverse_cdf(p: torch.Tensor, u: float) -> int:
    cdf = p.cumsum(0)
    return int(
        torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])]), right=True)[0].clamp(max=len(p) - 1)
    )


def _batch(num_drafts: list[int], vocab: int, seed: int, peaked: bool = True):
    generator = torch.Generator().manual_seed(seed)
    num_rows = sum(k + 1 for k in num_drafts)
    logits = torch.randn(num_rows, vocab, generator=generator) * (3.0 if peaked else 1.0)
    probs = torch.softmax(logits, dim=-1)
    argmax = probs.argmax(dim=-1)
    drafts: list[list[int]] = []
    row = 0
    for k in num_drafts:
        # Half the drafts are the target's argmax (accepted by greedy rows), half random.
        row_drafts = [
            int(argmax[row + j])
            if torch.rand(1, generator=generator) < 0.6
            else int(torch.randint(vocab, (1,)))
            for j in range(k)
        ]
        drafts.append(row_drafts)
        row += k + 1
    max_k = max(num_drafts)
    padded = torch.full((len(num_drafts), max_k), -1, dtype=torch.int64)
    for i, row_drafts in enumerate(drafts):
        padded[i, : len(row_drafts)] = torch.tensor(row_drafts, dtype=torch.int64)
    uniform = torch.rand(len(num_drafts), max_k + 1, generator=generator)
    return drafts, padded, torch.tensor(num_drafts), argmax, probs, uniform


def test_row_index_points_each_position_at_its_request_row():
    row_index, is_draft = draft_row_index(torch.tensor([2, 0, 3]), 3)
    assert row_index.tolist() == [[0, 1, 2, 2], [3, 3, 3, 3], [4, 5, 6, 7]]
    assert is_draft.tolist() == [[True, True, False], [False, False, False], [True, True, True]]


@pytest.mark.parametrize("seed", range(5))
def test_matches_the_naive_reference_for_greedy_sampled_and_mixed_rows(seed):
    num_drafts = [3, 1, 4, 2, 4, 1, 3, 2]
    drafts, padded, k, argmax, probs, uniform = _batch(num_drafts, vocab=7, seed=seed)
    greedy = [i % 3 == 0 for i in range(len(num_drafts))]
    out = rejection_sample(padded, k, argmax, probs, torch.tensor(greedy), uniform)
    want = naive_rejection_sample(drafts, argmax, probs, greedy, uniform)
    got = [row[: n + 1] for row, n in zip(out.output_token_ids.tolist(), out.num_accepted.tolist())]
    assert got == want
    # Past its emitted tokens a row holds the placeholder.
    for row, n in zip(out.output_token_ids.tolist(), out.num_accepted.tolist()):
        assert all(t == -1 for t in row[n + 1 :])


def test_all_greedy_needs_no_probabilities_and_emits_the_argmax_path():
    num_drafts = [4, 2, 3]
    drafts, padded, k, argmax, _, _ = _batch(num_drafts, vocab=5, seed=11)
    out = rejection_sample(padded, k, argmax, None, None, None)
    want = naive_rejection_sample(drafts, argmax, None, [True] * 3, None)
    assert [row[: n + 1] for row, n in zip(out.output_token_ids.tolist(), out.num_accepted.tolist())] == want


def test_a_draft_of_probability_one_is_always_accepted_and_of_zero_never():
    # Rows 0-1: request 0 (draft 1, of probability 1); rows 2-3: request 1 (draft 2, of probability 0).
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.3, 0.3, 0.4], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    argmax = probs.argmax(dim=-1)
    padded = torch.tensor([[1], [2]])
    uniform = torch.tensor([[0.999, 0.1], [0.0, 0.1]])
    out = rejection_sample(padded, torch.tensor([1, 1]), argmax, probs, torch.tensor([False, False]), uniform)
    assert out.num_accepted.tolist() == [1, 0]
    assert out.output_token_ids[1, 0] != 2  # the recovered token is never the rejected draft


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of ``counts`` against ``probs`` (cells of probability 0
    must be empty)."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token of probability 0 was drawn"
    n = counts.sum()
    expected = n * probs[support]
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(1 - torch.special.gammainc(torch.tensor(df / 2), statistic / 2))


def test_emitted_tokens_follow_the_target_distribution():
    """Many copies of one request with two drafts: its first token is distributed as p_0 and,
    after an accepted first draft, its second as p_1 (point-mass drafts are unbiased)."""
    torch.manual_seed(0)
    vocab, num = 6, 40_000
    p0 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
    p1 = torch.tensor([0.05, 0.40, 0.05, 0.10, 0.30, 0.10])
    p2 = torch.tensor([0.10, 0.10, 0.10, 0.10, 0.10, 0.50])
    probs = torch.stack([p0, p1, p2]).repeat(num, 1)
    argmax = probs.argmax(dim=-1)
    padded = torch.tensor([[1, 4]]).repeat(num, 1)
    out = rejection_sample(
        padded,
        torch.full((num,), 2),
        argmax,
        probs,
        torch.zeros(num, dtype=torch.bool),
        torch.rand(num, 3),
    )
    tokens = out.output_token_ids
    first = torch.bincount(tokens[:, 0], minlength=vocab).float()
    assert chi_square_p_value(first, p0) > 1e-3
    after_first_draft = tokens[tokens[:, 0] == 1]
    second = torch.bincount(after_first_draft[:, 1], minlength=vocab).float()
    assert chi_square_p_value(second, p1) > 1e-3
    # Both drafts accepted at rate p0(1) * p1(4).
    both = (out.num_accepted == 2).float().mean()
    assert abs(float(both) - 0.25 * 0.30) < 0.01
