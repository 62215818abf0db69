"""A snapshot of the engine core's queues, cache and counters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from itertools import zip_longest
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


def sum_engine_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """The stats of several engines (data-parallel replicas) as one engine's: counts added; the
    prefix cache hit rate is the replicas' mean (each one's lookups are not counted here)."""
    spec = [s.spec_decoding for s in stats if s.spec_decoding is not None]
    counts = {
        f.name: sum(getattr(s, f.name) for s in stats)
        for f in fields(EngineStats)
        if f.name not in ("prefix_cache_hit_rate", "spec_decoding")
    }
    return EngineStats(
        **counts,
        prefix_cache_hit_rate=sum(s.prefix_cache_hit_rate for s in stats) / max(len(stats), 1),
        spec_decoding=_sum_spec_decoding(spec) if spec else None,
    )


def _sum_spec_decoding(stats: list[SpecDecodingStats]) -> SpecDecodingStats:
    from pagedllm.core.spec_decode import SpecDecodingStats

    per_pos = zip_longest(*(s.num_accepted_tokens_per_pos for s in stats), fillvalue=0)
    return SpecDecodingStats(
        num_drafts=sum(s.num_drafts for s in stats),
        num_draft_tokens=sum(s.num_draft_tokens for s in stats),
        num_accepted_tokens=sum(s.num_accepted_tokens for s in stats),
        num_accepted_tokens_per_pos=[sum(counts) for counts in per_pos],
    )
