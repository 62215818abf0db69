"""A snapshot of the engine core's queues, cache and counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.core.spec_decode import SpecDecodingStats


@dataclass
class EngineStats:
    """A snapshot of the engine's queues, cache and counters."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_gpu_blocks: int
    num_gpu_blocks: int
    num_free_cpu_blocks: int
    num_cpu_blocks: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    # Tokens computed by prefills (prompts, and prompt + outputs recomputed after preemption).
    num_prefill_tokens: int
    # Tokens sampled.
    num_generation_tokens: int
    # Prompt tokens found in the prefix cache, over prompt tokens looked up (0 when it is off).
    prefix_cache_hit_rate: float
    # Speculative decoding's counters (None without it).
    spec_decoding: SpecDecodingStats | None = None

    @property
    def gpu_cache_usage(self) -> float:
        return 1.0 - self.num_free_gpu_blocks / max(self.num_gpu_blocks, 1)
