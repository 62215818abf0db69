"""Rejection sampling of draft tokens (speculative decoding), lossless: the tokens it emits are
distributed exactly as tokens sampled one at a time from the target model.

Leviathan et al. (2023), "Fast Inference from Transformers via Speculative Decoding", and Chen et
al. (2023), "Accelerating Large Language Model Decoding with Speculative Sampling": draft token
``d_j`` drawn from ``q_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the
first rejection the token is drawn from the recovered distribution ``norm(max(0, p_j - q_j))``,
and when every draft is accepted one more token is drawn from ``p_{k}``. Every request thus gains
between 1 and k + 1 tokens per verification.

Drafts here are deterministic (n-gram lookup): ``q_j`` is a point mass on ``d_j``, so a draft is
accepted with probability ``p_j(d_j)`` and the recovered distribution is ``p_j`` without ``d_j``,
renormalised. Greedy requests accept a draft when it is the target's argmax, and emit the argmax
at the first mismatch: their output is token for token the output without speculation.

Layout: a request i with ``k_i`` drafts owns ``k_i + 1`` consecutive rows of the target's
probabilities (row j scores the token after draft j - 1, i.e. judges draft j; the last row gives
the bonus token). Requests are padded to ``K = max k_i`` in [num_reqs, K (+ 1)] tensors; nothing
loops over requests but the draws of seeded ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLACEHOLDER_TOKEN_ID = -1


@dataclass
class RejectionSample:
    """On the probabilities' device."""

    # [num_reqs, K + 1] int64: accepted drafts, then the recovered or bonus token, then -1.
    output_token_ids: torch.Tensor
    # [num_reqs] int64: drafts accepted (the request emits one token more).
    num_accepted: torch.Tensor
    # [num_reqs, K + 1] int64: the target row each output position was scored by.
    row_index: torch.Tensor


def draft_row_index(num_drafts: torch.Tensor, max_num_drafts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """num_drafts: [num_reqs] int64. Returns the target row of each (request, position) [num_reqs,
    K + 1] (clamped to the request's last row past its drafts) and which positions judge a draft
    [num_reqs, K] bool."""
    positions = torch.arange(max_num_drafts + 1, device=num_drafts.device)
    first_row = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
    row_index = first_row[:, None] + torch.minimum(positions[None, :], num_drafts[:, None])
    is_draft = positions[None, :max_num_drafts] < num_drafts[:, None]
    return row_index, is_draft


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    target_argmax: torch.Tensor,
    target_probs: torch.Tensor | None,
    greedy: torch.Tensor | None,
    uniform: torch.Tensor | None,
    synthetic_acceptance_rate: float | None = None,
) -> RejectionSample:
    """Accept or reject every request's drafts against the target.

    Args:
        draft_token_ids: [num_reqs, K] int64, -1 past a request's drafts.
        num_drafts: [num_reqs] int64.
        target_argmax: [num_rows] int64: each row's most likely token under the (processed)
            target, which greedy requests take.
        target_probs: [num_rows, vocab] float32: each row's sampling distribution (temperature,
            top-k/p, min-p applied), or None when every request is greedy.
        greedy: [num_reqs] bool, or None when every request is greedy.
        uniform: [num_reqs, K + 1] float32 draws in [0, 1): K acceptance tests and the draw of the
            last token (a seeded request's from its own generator), or None when all are greedy.
        synthetic_acceptance_rate: benchmarks only: accept each draft with this probability,
            whatever the target says (the output is then not the model's).
    """
    max_num_drafts = draft_token_ids.shape[1]
    row_index, is_draft = draft_row_index(num_drafts, max_num_drafts)
    target_tokens = target_argmax[row_index]  # [num_reqs, K + 1]
    # [num_reqs, K + 1]: the drafts, then -1 in the bonus position.
    padded = torch.nn.functional.pad(draft_token_ids, (0, 1), value=PLACEHOLDER_TOKEN_ID)
    drafts = draft_token_ids.clamp(min=0)
    accepted = (drafts == target_tokens[:, :max_num_drafts]) & is_draft
    if target_probs is not None:
        assert greedy is not None and uniform is not None
        # A point-mass draft is accepted with probability p(d).
        p_draft = target_probs[row_index[:, :max_num_drafts], drafts]
        sampled_accept = (uniform[:, :max_num_drafts] < p_draft) & is_draft
        accepted = torch.where(greedy[:, None], accepted, sampled_accept)
    if synthetic_acceptance_rate is not None:
        draws = torch.rand(accepted.shape, device=accepted.device)
        accepted = (draws < synthetic_acceptance_rate) & is_draft
    # Drafts accepted before the first rejection.
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)
    last_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    if target_probs is not None:
        last_row = row_index.gather(1, num_accepted[:, None]).squeeze(1)
        # The rejected draft (-1 when every draft was accepted: the bonus row keeps its mass).
        rejected_draft = padded.gather(1, num_accepted[:, None]).squeeze(1)
        sampled = sample_recovered(target_probs[last_row], rejected_draft, uniform[:, -1])
        last_token = torch.where(greedy, last_token, sampled)
    positions = torch.arange(max_num_drafts + 1, device=padded.device)
    output = padded.masked_fill(positions[None, :] >= num_accepted[:, None], PLACEHOLDER_TOKEN_ID)
    output.scatter_(1, num_accepted[:, None], last_token[:, None])
    return RejectionSample(output, num_accepted, row_index)


def sample_recovered(probs: torch.Tensor, removed: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row from ``probs`` [rows, vocab] without token ``removed`` [rows] (-1: none),
    renormalised, by inverting the CDF at ``uniform`` [rows]. (When the draft held every bit of
    the mass it was accepted, so a rejected row always has mass left.)"""
    rows = torch.arange(len(removed), device=probs.device)
    probs = probs.clone()
    has_removed = removed >= 0
    probs[rows[has_removed], removed[has_removed]] = 0.0
    cdf = probs.cumsum(dim=-1)
    # right=True: the first token whose CDF passes the draw, so a token of probability 0 (its CDF
    # equal to its predecessor's) is never chosen.
    tokens = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(-1)
    # A draw that rounds up to the whole mass falls past the end: the most likely token then.
    return torch.where(tokens < probs.shape[1], tokens, probs.argmax(dim=-1))
