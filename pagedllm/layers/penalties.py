"""Repetition, presence and frequency penalties, batched over rows on the device.

- repetition_penalty (HF's RepetitionPenaltyLogitsProcessor): every token seen in the prompt or
  the output has its logit divided by the penalty when positive, multiplied when negative.
- presence_penalty and frequency_penalty (OpenAI): over the output only,
  ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.

Counts come from one scatter-add of each row's token ids (padded with an out-of-vocabulary id that
lands in a discarded extra column), so the cost is one pass over the ids, not a loop per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.layers.sampler import SamplingGroup


def apply_penalties(logits: torch.Tensor, groups: list[SamplingGroup]) -> torch.Tensor:
    """logits: [num_rows, vocab]. Returns the penalised logits (the input itself when no row has a
    penalty)."""
    if not any(_has_penalty(group) for group in groups):
        return logits
    num_rows, vocab_size = logits.shape
    device = logits.device
    presence, frequency, repetition = [], [], []
    outputs: list[list[int]] = []
    prompts: list[list[int]] = []
    for group in groups:
        p = group.params
        num = len(group.seq_ids)
        presence += [p.presence_penalty] * num
        frequency += [p.frequency_penalty] * num
        repetition += [p.repetition_penalty] * num
        outputs += group.output_token_ids or [[] for _ in range(num)]
        prompts += [group.prompt_token_ids or []] * num
    output_counts = _token_counts(outputs, num_rows, vocab_size, device)
    seen = output_counts > 0
    if any(r != 1.0 for r in repetition):
        seen_anywhere = seen | (_token_counts(prompts, num_rows, vocab_size, device) > 0)
        penalty = torch.tensor(repetition, dtype=logits.dtype, device=device)[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen_anywhere, penalised, logits)
    frequency_t = torch.tensor(frequency, dtype=logits.dtype, device=device)[:, None]
    presence_t = torch.tensor(presence, dtype=logits.dtype, device=device)[:, None]
    return logits - frequency_t * output_counts - presence_t * seen


def _has_penalty(group: SamplingGroup) -> bool:
    p = group.params
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _token_counts(
    rows: list[list[int]], num_rows: int, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[num_rows, vocab] float32: how often each token appears in each row's list."""
    width = max((len(row) for row in rows), default=0)
    counts = torch.zeros(num_rows, vocab_size + 1, device=device)
    if width:
        # Padding with vocab_size counts into the extra column, cut below.
        ids = torch.full((num_rows, width), vocab_size, dtype=torch.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
        ids = ids.to(device, non_blocking=True)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab_size]
