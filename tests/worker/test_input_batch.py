"""The persistent batch's output history on the host: what a grammar or bad words read."""

from __future__ import annotations

import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.step_io import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.worker.input_batch import InputBatch


def _add(batch: InputBatch, req_id: int, prompt: list[int], outputs: list[int]) -> int:
    batch.add_request(
        NewRequestData(
            req_id=req_id,
            seed=None,
            prompt_token_ids=prompt,
            output_token_ids=outputs,
            sampling_params=SamplingParams(max_tokens=16),
            block_ids=[0],
            num_computed_tokens=len(prompt) + len(outputs),
            num_samples=1,
            min_tokens_stop_ids=[],
            num_top_tokens=0,
        )
    )
    return batch.row_of[req_id]


def test_output_token_ids_from_any_start_joins_sent_and_sampled_tokens():
    batch = InputBatch(4, 8, 1000, torch.device("cpu"))
    # A resumed request: its host knew two outputs; the worker then sampled three more.
    row = _add(batch, 7, [1, 2, 3], [40, 41])
    for index, token in zip((2, 3, 4), (50, 51, 52)):
        batch.append_sampled([(7, index, token)])
    batch.append_sampled([(7, 3, 99)])  # a sample already recorded: ignored
    outputs = [40, 41, 50, 51, 52]
    for start in range(len(outputs) + 2):
        assert batch.output_token_ids(row, start) == outputs[start:]
    assert batch.output_token_ids(row) == outputs
    fresh = _add(batch, 8, [5], [])
    assert batch.output_token_ids(fresh, 0) == [] and batch.output_token_ids(fresh, 3) == []


def _new(req_id: int, prompt: list[int], block_ids: list[int], **params) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        seed=params.pop("seed", None),
        prompt_token_ids=prompt,
        output_token_ids=[],
        sampling_params=SamplingParams(max_tokens=16, **params),
        block_ids=block_ids,
        num_computed_tokens=0,
        num_samples=1,
        min_tokens_stop_ids=[],
        num_top_tokens=0,
    )


def test_apply_scheduler_output_adds_updates_and_frees_rows():
    batch = InputBatch(4, 4, 1000, torch.device("cpu"))
    first = SchedulerOutput(
        scheduled_new_reqs=[
            _new(1, [1, 2, 3, 4, 5], [7, 8], seed=3, temperature=1.0),
            _new(2, [6, 7], [9], seed=4, temperature=1.0),
            _new(3, [8], [2], prompt_logprobs=0),
        ]
    )
    batch.apply_scheduler_output(first)
    rows = [batch.row_of[r] for r in (1, 2, 3)]
    assert sorted(rows) == [0, 1, 2] and set(batch.generators) == {1, 2}
    assert batch.wants_prompt_logprobs[rows].tolist() == [False, False, True]
    # Request 1 computed its prompt and appends a third block; 2 computed its prompt, no new
    # block; a window dropped 1's first 4 tokens; 3 finished; 2 is preempted.
    second = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[1], block_table_diffs=[(2, [5])], num_computed_tokens=[5]
        ),
        num_dropped_tokens={1: 4},
        finished_req_ids={3},
        preempted_req_ids={2},
    )
    batch.apply_scheduler_output(second)
    row = batch.row_of[1]
    assert batch.num_computed_tokens[row] == 5 and batch.num_dropped_tokens[row] == 4
    assert batch.block_table[row, :3].tolist() == [7, 8, 5]
    assert batch.block_table_device[row, :3].tolist() == [7, 8, 5]
    assert set(batch.row_of) == {1}
    # A preempted request keeps its seeded generator: it comes back.
    assert set(batch.generators) == {1, 2}
    # Rows are reused: the freed ones serve new requests.
    batch.apply_scheduler_output(SchedulerOutput(scheduled_new_reqs=[_new(4, [1], [3]), _new(5, [1], [4])]))
    assert {batch.row_of[4], batch.row_of[5]} == set(rows) - {row}
