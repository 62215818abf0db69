"""``--profile-steps N``: N engine steps profiled on every rank (``LLMEngine.start_profile``).

Each rank reports, per step, how long its host took to issue the step and how long its device
ran it and waited before it (CUDA events at each step's start and end: exact, and cheap enough
not to move the figure); with ``--profile-mode torch`` also its device's busy time over the steps
against the span of its events, the idle gaps between them and the busiest operations
(``worker/profiler.py``). A host-bound step (the device waits) reads apart from a device-bound
one, rank by rank, under tensor and pipeline parallelism too.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from pagedllm.engine.llm_engine import LLMEngine

PROFILE_MODES = ("torch", "events")


def add_profile_args(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--profile-steps", type=int, default=0, help=f"profile N {what} on every rank")
    parser.add_argument(
        "--profile-mode",
        choices=PROFILE_MODES,
        default="torch",
        help="torch: the torch profiler too (its host overhead slows a host-bound step); events: "
        "only each step's start and end, as CUDA events",
    )


def profile_steps_of(engine: LLMEngine, num_steps: int, mode: str = "torch") -> dict[str, Any]:
    """Wall time per step, and per rank: the steps' medians, with the torch profiler its device
    busy time, span and gaps per step and the busiest operations (``tables``, by rank)."""
    if mode not in PROFILE_MODES:
        raise ValueError(f"profile mode {mode!r}: expected one of {', '.join(PROFILE_MODES)}")
    engine.start_profile(torch_profiler=mode == "torch")
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    ranks = engine.stop_profile()  # each rank waits for its device first
    wall_s = time.perf_counter() - start
    tables = {s["rank"]: s.pop("table") for s in ranks if "table" in s}
    per_rank = []
    for s in ranks:
        r: dict[str, Any] = {"rank": s["rank"], "steps": s["steps"]}
        if "busy_us" in s:
            r.update(
                busy_ms_per_step=s["busy_us"] / 1e3 / num_steps,
                span_ms_per_step=s["span_us"] / 1e3 / num_steps,
                gaps_ms_per_step=s["gaps_us"] / 1e3 / num_steps,
                gaps_per_step=s["num_gaps"] / num_steps,
                largest_gaps_us=list(s["largest_gaps_us"]),
                device_events=s["num_events"],
                trace=s["trace"],
            )
        per_rank.append(r)
    first = per_rank[0]
    return {
        "mode": mode,
        "num_steps": num_steps,
        # Includes stopping the profile (with the torch profiler: its post-processing).
        "wall_ms_per_step": 1e3 * wall_s / num_steps,
        # The first rank's, as the one-process figure always was (each rank's in "ranks").
        "device_ms_per_step": first.get("busy_ms_per_step", first["steps"].get("device_step_ms")),
        "ranks": per_rank,
        "tables": tables,
    }


def print_profile(profiled: dict[str, Any], label: str) -> None:
    """Each rank's table, then a line or two per rank."""
    for rank, table in sorted(profiled.pop("tables").items()):
        print(f"rank {rank}:\n{table}")
    print(f"{label} (profiled: {profiled['num_steps']} steps, {profiled['mode']})")
    for r in profiled["ranks"]:
        print(f"  rank {r['rank']}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in r["steps"].items()))
        if "busy_ms_per_step" in r:
            gaps = ", ".join(f"{g:.0f}" for g in r["largest_gaps_us"])
            print(
                f"  rank {r['rank']} (torch profiler): device busy {r['busy_ms_per_step']:.3f} ms of a "
                f"{r['span_ms_per_step']:.3f} ms span per step; {r['gaps_per_step']:.1f} idle gaps of "
                f">= 10 us per step, {r['gaps_ms_per_step']:.3f} ms; largest (us): {gaps or 'none'}"
            )


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
