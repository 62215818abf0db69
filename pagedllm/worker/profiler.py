"""A rank's own profile of the steps it runs: ``LLM.start_profile()`` / ``stop_profile()``.

With tensor or pipeline parallelism the devices belong to the rank processes, so a profiler in
the engine's process sees only its own host work: each rank profiles itself (as vLLM's workers
do) and answers with a summary of its device timeline. The summary is what tells a host-bound
step from a device-bound one: the device's busy time (the union of its kernels' and copies'
intervals) against the span they cover, and the idle gaps between them, largest first. A step
whose device is busy for most of its span is bound by its kernels; large gaps at the step's
boundaries are host work (or a peer) the device waited for.

``$PAGEDLLM_TORCH_PROFILER_DIR`` (vLLM's ``VLLM_TORCH_PROFILER_DIR``), when set, also keeps each
rank's whole trace there (``rank{r}-{pid}-{n}.json``: chrome://tracing or Perfetto).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

TRACE_DIR_ENV = "PAGEDLLM_TORCH_PROFILER_DIR"
# Idle stretches of the device shorter than this are the normal seam between two kernels.
GAP_THRESHOLD_US = 10.0
# The largest gaps reported, and the table's rows.
NUM_LARGEST_GAPS = 8
TABLE_ROWS = 25


@dataclass(frozen=True)
class DeviceTimeline:
    """What a set of device intervals says, in microseconds."""

    num_events: int
    busy_us: float  # the union of the intervals
    span_us: float  # first start to last end
    idle_us: float  # span - busy
    num_gaps: int  # idle stretches of at least GAP_THRESHOLD_US
    gaps_us: float  # their total
    largest_gaps_us: tuple[float, ...]


def device_timeline(intervals: list[tuple[float, float]]) -> DeviceTimeline:
    """The busy time, span and idle gaps of (start, end) intervals, which may overlap (streams)."""
    if not intervals:
        return DeviceTimeline(0, 0.0, 0.0, 0.0, 0, 0.0, ())
    ordered = sorted(intervals)
    busy = 0.0
    gaps: list[float] = []
    run_start, run_end = ordered[0]
    for start, end in ordered[1:]:
        if start > run_end:
            busy += run_end - run_start
            gaps.append(start - run_end)
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
    busy += run_end - run_start
    span = run_end - ordered[0][0]
    large = sorted((g for g in gaps if g >= GAP_THRESHOLD_US), reverse=True)
    return DeviceTimeline(
        num_events=len(intervals),
        busy_us=busy,
        span_us=span,
        idle_us=span - busy,
        num_gaps=len(large),
        gaps_us=sum(large),
        largest_gaps_us=tuple(large[:NUM_LARGEST_GAPS]),
    )


class WorkerProfiler:
    """One rank's torch profiler, on between ``start()`` and ``stop()``."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self._profile: profile | None = None
        self._num_traces = 0

    def start(self) -> None:
        if self._profile is not None:
            raise RuntimeError(f"rank {self.rank}: a profile is already running (stop_profile() first)")
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)  # the profile holds only what runs from here
        self._profile = profile(activities=activities)
        self._profile.start()

    def stop(self) -> dict[str, Any]:
        """End the profile; this rank's summary (``device_timeline``'s fields, the busiest
        operations as a table, and the trace's path where one was kept)."""
        if self._profile is None:
            raise RuntimeError(f"rank {self.rank}: no profile is running (start_profile() first)")
        prof, self._profile = self._profile, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the device's last events reach the profile
        prof.stop()
        intervals = [
            (event.time_range.start, event.time_range.end)
            for event in prof.events()
            if event.device_type == DeviceType.CUDA
        ]
        sort_by = "self_device_time_total" if intervals else "self_cpu_time_total"
        summary: dict[str, Any] = {
            "rank": self.rank,
            **device_timeline(intervals).__dict__,
            "table": prof.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS),
            "trace": None,
        }
        trace_dir = os.environ.get(TRACE_DIR_ENV)
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            path = os.path.join(trace_dir, f"rank{self.rank}-{os.getpid()}-{self._num_traces}.json")
            prof.export_chrome_trace(path)
            self._num_traces += 1
            summary["trace"] = path
        return summary
