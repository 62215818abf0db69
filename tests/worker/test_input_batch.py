"""The persistent batch's output history on the host: what a grammar or bad words read."""

from __future__ import annotations

import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.step_io import NewRequestData
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
