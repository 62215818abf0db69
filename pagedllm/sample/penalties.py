"""Repetition, presence and frequency penalties, batched over rows on the device.

- repetition_penalty (HF's RepetitionPenaltyLogitsProcessor): every token seen in the prompt or
  the output has its logit divided by the penalty when positive, multiplied when negative.
- presence_penalty and frequency_penalty (OpenAI): over the output only,
  ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.

The counts live on the device in the worker's persistent batch and grow by one scatter per step
(the sampled tokens never leave the device for this), so applying penalties is a few elementwise
passes over [rows, vocab], whatever the outputs' lengths.
"""

from __future__ import annotations

import torch

from pagedllm.sample.metadata import SamplingMetadata


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """logits: [num_rows, vocab]. Returns the penalised logits (the input itself when no row has a
    penalty)."""
    if not metadata.has_penalties:
        return logits
    counts = metadata.output_counts
    assert counts is not None
    seen = counts > 0
    if metadata.prompt_mask is not None:
        repetition = metadata.repetition_penalty[:, None].to(logits.dtype)
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen | metadata.prompt_mask, penalised, logits)
    frequency = metadata.frequency_penalty[:, None].to(logits.dtype)
    presence = metadata.presence_penalty[:, None].to(logits.dtype)
    return logits - frequency * counts - presence * seen


def ban_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Rows under min_tokens cannot pick EOS or a stop token (in place)."""
    if metadata.banned_rows is not None:
        logits[metadata.banned_rows, metadata.banned_token_ids] = float("-inf")


def penalised(logits: torch.Tensor, metadata: SamplingMetadata, copy: bool) -> torch.Tensor:
    """The logits with the rows' penalties and min_tokens bans applied: ``logits`` itself when
    neither applies. Without ``copy`` the bans may be written into ``logits`` (when no row has a
    penalty); with it ``logits`` is never written (the caller reads it after). Each part is skipped
    when no row has it: this runs once per step."""
    x = apply_penalties(logits, metadata) if metadata.has_penalties else logits
    if metadata.banned_rows is not None:
        if copy and x is logits:
            x = logits.clone()
        ban_tokens(x, metadata)
    return x
