"""``--profile-steps N``: N engine steps profiled on every rank (``LLMEngine.start_profile``).

Each rank reports its device's busy time over the steps against the span of its events and the
idle gaps between them (``worker/profiler.py``), so a host-bound step (large gaps) reads apart
from a device-bound one, rank by rank, under tensor and pipeline parallelism too.
"""

from __future__ import annotations

import time
from typing import Any

from pagedllm.engine.llm_engine import LLMEngine


def profile_steps_of(engine: LLMEngine, num_steps: int) -> dict[str, Any]:
    """Wall time per step, and per rank: device busy time, span and gaps per step, and the
    busiest operations (``tables``, by rank)."""
    engine.start_profile()
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    ranks = engine.stop_profile()  # each rank waits for its device first
    wall_s = time.perf_counter() - start
    tables = {summary["rank"]: summary.pop("table") for summary in ranks}
    per_step = [
        {
            "rank": s["rank"],
            "busy_ms_per_step": s["busy_us"] / 1e3 / num_steps,
            "span_ms_per_step": s["span_us"] / 1e3 / num_steps,
            "gaps_ms_per_step": s["gaps_us"] / 1e3 / num_steps,
            "gaps_per_step": s["num_gaps"] / num_steps,
            "largest_gaps_us": list(s["largest_gaps_us"]),
            "device_events": s["num_events"],
            "trace": s["trace"],
        }
        for s in ranks
    ]
    return {
        "num_steps": num_steps,
        "wall_ms_per_step": 1e3 * wall_s / num_steps,
        # The first rank's, as the one-process figure always was (each rank's in "ranks").
        "device_ms_per_step": per_step[0]["busy_ms_per_step"],
        "ranks": per_step,
        "tables": tables,
    }


def print_profile(profiled: dict[str, Any], label: str) -> None:
    """The first rank's table, then a line per rank."""
    tables = profiled.pop("tables")
    print(tables[min(tables)])
    wall = profiled["wall_ms_per_step"]
    print(f"{label} (profiled, {profiled['num_steps']} steps): {wall:.2f} ms of wall time per step")
    for r in profiled["ranks"]:
        gaps = ", ".join(f"{g:.0f}" for g in r["largest_gaps_us"])
        print(
            f"  rank {r['rank']}: device busy {r['busy_ms_per_step']:.3f} ms of a "
            f"{r['span_ms_per_step']:.3f} ms span per step; {r['gaps_per_step']:.1f} idle gaps of "
            f">= 10 us per step, {r['gaps_ms_per_step']:.3f} ms; largest (us): {gaps or 'none'}"
        )
