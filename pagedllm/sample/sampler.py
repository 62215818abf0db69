"""Turns logits into next tokens: penalties, greedy, temperature, top-k, top-p, min-p, seeds,
the logprobs users ask for, and beam search's candidates.

Each row of the logits is one sample to draw (the worker repeats a request's row when it draws
``best_of`` first tokens from its prompt); every parameter is a per-row tensor of
``SamplingMetadata``. Everything stays on the device: the results go back to the host in one
copy, which the worker may leave in flight while the next step is scheduled.

Sampling uses the exponential race: with ``q ~ Exp(1)`` i.i.d. per token,
``argmax(p / q)`` is distributed as ``p``. It needs no cumulative sums, and a seeded row just
draws its ``q`` from its own generator, so its tokens do not depend on the rest of the batch.

Logprobs are those of the model (log_softmax of the raw logits), whatever penalties and
truncation did to the sampling distribution, as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.penalties import apply_penalties, ban_tokens


@dataclass
class SamplerOutput:
    """On the logits' device, one entry per row."""

    token_ids: torch.Tensor  # [num_rows] int64
    logprobs: torch.Tensor  # [num_rows] float32: the chosen tokens' logprobs
    # When some row asked for top tokens: [num_rows] int64 ranks of the chosen tokens (1 = most
    # likely), [num_rows, k] the k most likely tokens and their logprobs (beam rows: penalised).
    ranks: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [num_rows, vocab_size] float32."""
        logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_penalties(logits, metadata)
        ban_tokens(logits, metadata)
        token_ids = logits.argmax(dim=-1)
        if not metadata.all_greedy:
            sampled = _sample_random(logits, metadata)
            token_ids = torch.where(metadata.greedy, token_ids, sampled)
        chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
        output = SamplerOutput(token_ids=token_ids, logprobs=chosen)
        if metadata.max_num_top_tokens:
            scores = _beam_scores(logprobs, metadata)
            output.top_logprobs, output.top_token_ids = scores.topk(metadata.max_num_top_tokens, dim=-1)
            output.ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
        return output


def _beam_scores(logprobs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """What top tokens are ranked by: the logprobs; for beam search rows, the logprobs with the
    penalties and min_tokens bans applied (HF's beam search applies its processors to them)."""
    if metadata.beam is None:
        return logprobs
    scores = apply_penalties(logprobs, metadata)
    if scores is logprobs:
        scores = logprobs.clone()
    ban_tokens(scores, metadata)
    return torch.where(metadata.beam[:, None], scores, logprobs)


def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    logits = logits / metadata.temperature[:, None]
    if metadata.top_k is not None or metadata.top_p is not None:
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    probs = torch.softmax(logits, dim=-1)
    if metadata.min_p is not None:
        probs = apply_min_p(probs, metadata.min_p)
    q = torch.empty_like(probs).exponential_()
    for row, generator in metadata.generators.items():
        q[row].exponential_(generator=generator)
    return (probs / q).argmax(dim=-1)


def apply_top_k_top_p(
    logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None
) -> torch.Tensor:
    """Mask to -inf every token outside each row's top k and outside its top-p nucleus.

    logits: [num_rows, vocab]; top_ks: [num_rows] int64 (vocab = off); top_ps: [num_rows].
    """
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[-1]
    if top_ks is not None:
        # The k-th largest value, and everything below it, goes (ties with it stay).
        kth = sorted_logits.gather(-1, (vocab_size - top_ks)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_ps is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= 1.0 - top_ps[:, None]
        outside[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Zero tokens less likely than min_p times the row's most likely one. probs: [rows, vocab]."""
    threshold = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
    return probs.masked_fill(probs < threshold, 0.0)
