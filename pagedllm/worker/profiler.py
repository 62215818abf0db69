"""A rank's own profile of the steps it runs: ``LLM.start_profile()`` / ``stop_profile()``.

With tensor or pipeline parallelism the devices belong to the rank processes, so a profiler in
the engine's process sees only its own host work: each rank profiles itself (as vLLM's workers
do) and answers with a summary of its device timeline. The summary is what tells a host-bound
step from a device-bound one: the device's busy time (the union of its kernels' and copies'
intervals) against the span they cover, and the idle gaps between them, largest first. A step
whose device is busy for most of its span is bound by its kernels; large gaps at the step's
boundaries are host work (or a peer) the device waited for.

The torch profiler slows the host (it records every operation the host issues), so its gaps
overstate a host-bound step's. Each profile therefore also records, at almost no cost, a CUDA
event where each step's work starts and one after its last launch: the device's time from one
step's end to the next one's start is exactly how long it waited for the host; ``torch_profiler=
False`` keeps only those (``step_timeline``).

``$PAGEDLLM_TORCH_PROFILER_DIR`` (vLLM's ``VLLM_TORCH_PROFILER_DIR``), when set, also keeps each
rank's whole trace there (``rank{r}-{pid}-{n}.json``: chrome://tracing or Perfetto).
"""

from __future__ import annotations

import itertools
import os
import time
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


def step_timeline(
    host_marks: list[tuple[float, float]], device_marks: list[tuple[Any, Any]] | None
) -> dict[str, Any]:
    """Medians (ms) over the steps: the host's time to issue a step and from one step's start to
    the next; on a GPU the device's time per step, and its idle time before each step after the
    first (``device_marks``: (start, end) CUDA events, completed)."""
    out: dict[str, Any] = {"num_steps": len(host_marks)}
    if not host_marks:
        return out
    out["host_issue_ms"] = 1e3 * _median([end - start for start, end in host_marks])
    periods = [b[0] - a[0] for a, b in itertools.pairwise(host_marks)]
    out["host_period_ms"] = 1e3 * _median(periods) if periods else None
    if device_marks:
        steps = [start.elapsed_time(end) for start, end in device_marks]
        waits = [max(0.0, a[1].elapsed_time(b[0])) for a, b in itertools.pairwise(device_marks)]
        out["device_step_ms"] = _median(steps)
        out["device_wait_ms"] = _median(waits) if waits else None
        out["device_wait_total_ms"] = sum(waits)
        out["device_total_ms"] = device_marks[0][0].elapsed_time(device_marks[-1][1])
    return out


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class WorkerProfiler:
    """One rank's profile, on between ``start()`` and ``stop()``; the worker marks each step's
    start and end (``step_started`` / ``step_issued``) while ``active``."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self.active = False
        self._profile: profile | None = None
        self._num_traces = 0
        self._host_marks: list[tuple[float, float]] = []
        self._device_marks: list[tuple[Any, Any]] = []
        self._started: tuple[float, Any] | None = None

    def start(self, torch_profiler: bool = True) -> None:
        if self.active:
            raise RuntimeError(f"rank {self.rank}: a profile is already running (stop_profile() first)")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the profile holds only what runs from here
        if torch_profiler:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._profile = profile(activities=activities)
            self._profile.start()
        self._host_marks, self._device_marks, self.active = [], [], True

    def step_started(self) -> None:
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self._started = (time.perf_counter(), event)

    def step_issued(self) -> None:
        assert self._started is not None, "step_started() first"
        start, start_event = self._started
        self._host_marks.append((start, time.perf_counter()))
        if start_event is not None:
            end_event = torch.cuda.Event(enable_timing=True)
            end_event.record()
            self._device_marks.append((start_event, end_event))
        self._started = None

    def stop(self) -> dict[str, Any]:
        """End the profile; this rank's summary: ``step_timeline``'s medians under "steps", and
        with the torch profiler ``device_timeline``'s fields, the busiest operations as a table
        and the trace's path where one was kept."""
        if not self.active:
            raise RuntimeError(f"rank {self.rank}: no profile is running (start_profile() first)")
        self.active = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the device's last events reach the profile
        summary: dict[str, Any] = {
            "rank": self.rank,
            "steps": step_timeline(self._host_marks, self._device_marks),
        }
        prof, self._profile = self._profile, None
        if prof is None:
            return summary
        prof.stop()
        intervals = [
            (event.time_range.start, event.time_range.end)
            for event in prof.events()
            if event.device_type == DeviceType.CUDA
        ]
        sort_by = "self_device_time_total" if intervals else "self_cpu_time_total"
        summary.update(device_timeline(intervals).__dict__)
        summary["table"] = prof.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS)
        summary["trace"] = None
        trace_dir = os.environ.get(TRACE_DIR_ENV)
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            path = os.path.join(trace_dir, f"rank{self.rank}-{os.getpid()}-{self._num_traces}.json")
            prof.export_chrome_trace(path)
            self._num_traces += 1
            summary["trace"] = path
        return summary
