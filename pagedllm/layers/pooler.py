"""Poolers: one prompt's final hidden states -> one vector (vLLM's LAST, MEAN and CLS pooling).

A prompt may be computed over several steps (chunked prefill), so a pooler folds each chunk's
hidden states into a small running state as the chunk is computed, and ``finish`` turns the state
into the vector once the prompt's last chunk is in. The state is one [hidden_size] vector per
request in flight, whatever the prompt's length:

    LAST    the newest chunk's last row (the prompt's last token, once the last chunk is in)
    MEAN    the float32 sum of every row so far, divided by the prompt's length at the end
    CLS     the first chunk's first row

Normalization and Matryoshka truncation are per request and happen in the frontend
(``engine/pooling_output.py``); a pooler only reduces.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagedllm.pooling_params import PoolerConfig


class Pooler(Protocol):
    def pool_chunk(self, state: torch.Tensor | None, hidden_states: torch.Tensor) -> torch.Tensor:
        """Fold a chunk (hidden_states: [num_chunk_tokens, hidden_size], in prompt order) into the
        request's state (None before its first chunk); returns the new state, [hidden_size]."""
        ...

    def finish(self, state: torch.Tensor, num_prompt_tokens: int) -> torch.Tensor:
        """The pooled vector, [hidden_size] float32, from the state after the last chunk."""
        ...


class LastPool:
    def pool_chunk(self, state: torch.Tensor | None, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states[-1].float()

    def finish(self, state: torch.Tensor, num_prompt_tokens: int) -> torch.Tensor:
        return state


class MeanPool:
    def pool_chunk(self, state: torch.Tensor | None, hidden_states: torch.Tensor) -> torch.Tensor:
        chunk_sum = hidden_states.float().sum(dim=0)
        return chunk_sum if state is None else state + chunk_sum

    def finish(self, state: torch.Tensor, num_prompt_tokens: int) -> torch.Tensor:
        return state / num_prompt_tokens


class ClsPool:
    def pool_chunk(self, state: torch.Tensor | None, hidden_states: torch.Tensor) -> torch.Tensor:
        # A copy: a CUDA graph's output buffer is overwritten by the next replay.
        return hidden_states[0].float().clone() if state is None else state

    def finish(self, state: torch.Tensor, num_prompt_tokens: int) -> torch.Tensor:
        return state


_POOLERS: dict[str, type[Pooler]] = {"LAST": LastPool, "MEAN": MeanPool, "CLS": ClsPool}


def get_pooler(pooler_config: PoolerConfig) -> Pooler:
    """The pooler the model's config names (chosen once, at the runner's construction)."""
    return _POOLERS[pooler_config.pooling_type]()
