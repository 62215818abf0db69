"""When a pipeline stage before the last records the samples it received: before the step that
runs, ends, preempts or adds one of their requests, in the order they were broadcast, and never
more than one step per stage behind (no process group here: the broadcasts are no-ops)."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.step_io import NewRequestData, SchedulerOutput
from pagedllm.worker.pipeline import PipelineStage


def first_stage() -> PipelineStage:
    return PipelineStage(0, 2, 0, 8, torch.float32, torch.device("cpu"))


def step(scheduled=(), finished=(), preempted=(), new=()) -> SchedulerOutput:
    out = SchedulerOutput(finished_req_ids=set(finished), preempted_req_ids=set(preempted))
    out.num_scheduled_tokens = {req_id: 1 for req_id in scheduled}
    out.scheduled_new_reqs = [NewRequestData(req_id, None, [1], [], None, [0], 0, 1, [], 0) for req_id in new]
    return out


def defer(stage: PipelineStage, req_ids: list[int]) -> None:
    stage.defer_samples(len(req_ids), req_ids, np.arange(len(req_ids)))


def received(stage: PipelineStage, scheduler_output: SchedulerOutput) -> list[list[int]]:
    return [samples.req_ids for samples in stage.samples_before(scheduler_output)]


def test_samples_wait_until_a_step_touches_their_requests_then_come_in_order():
    stage = first_stage()
    defer(stage, [1, 2])
    defer(stage, [3])
    assert received(stage, step(scheduled=[7])) == []  # other requests: nothing needed yet
    assert received(stage, step(scheduled=[3])) == [[1, 2], [3]]  # the older ones first
    assert received(stage, step(scheduled=[1, 2, 3])) == []


def test_ending_preempting_or_readding_a_request_takes_its_samples_first():
    for touching in (step(finished=[2]), step(preempted=[2]), step(new=[2])):
        stage = first_stage()
        defer(stage, [1, 2])
        assert received(stage, touching) == [[1, 2]]


def test_no_more_than_one_step_per_stage_waits():
    stage = first_stage()
    for req_id in range(4):
        defer(stage, [req_id])
    assert received(stage, step(scheduled=[9])) == [[0], [1]]
