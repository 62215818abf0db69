"""The per-row sampling parameters of one step, as tensors on the logits' device.

Rows are the samples a step draws, in the order of the step's logits: one per sampling request,
``num_samples`` for a request drawing its best_of first tokens. The worker builds this from its
persistent batch (worker/input_batch.py); the sampler never sees a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    # [num_rows] float32, 1.0 for greedy rows; None when every row is greedy.
    temperature: torch.Tensor | None
    # [num_rows] bool: greedy (or beam search) rows; None when every row is greedy.
    greedy: torch.Tensor | None
    all_greedy: bool
    # [num_rows] int64 (vocab size = off), float32, float32; None when no row uses them.
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    # Row -> the seeded generator it draws its noise from (rows without one use the global one).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Penalties ([num_rows] each) with the counts they need, or None when no row has one.
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    # [num_rows, vocab] float32: each row's output token counts (penalties only).
    output_counts: torch.Tensor | None = None
    # [num_rows, vocab] bool: tokens in each row's prompt (repetition penalty only).
    prompt_mask: torch.Tensor | None = None
    # (rows, token ids) banned because their row has fewer than min_tokens outputs.
    banned_rows: torch.Tensor | None = None
    banned_token_ids: torch.Tensor | None = None
    # Most likely tokens returned for rows that asked (0: none did).
    max_num_top_tokens: int = 0
    # [num_rows] bool: beam search rows, ranked by penalised logprobs; None when there are none.
    beam: torch.Tensor | None = None

    @property
    def truncates(self) -> bool:
        """Some row keeps only part of its distribution (top-k, top-p or min-p)."""
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    @property
    def has_penalties(self) -> bool:
        return self.output_counts is not None
