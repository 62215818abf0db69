"""The worker's side of speculative decoding with asynchronous scheduling, on hand-made inputs:
placeholder drafts resolved from the drafter's device buffer into the verifier's drafts and the
step's input ids, and the rejections of the step before taken back from optimistic computed
counts. Expected values are worked out by hand in the comments."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from pagedllm.layers import custom_op
from pagedllm.sampling_params import SamplingParams
from pagedllm.step_io import DRAFT_PLACEHOLDER, NewRequestData, SchedulerOutput
from pagedllm.worker import spec_decode
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.spec_decode import DeviceDrafts, DraftVerifier
from pagedllm.worker.step_inputs import verify_rows

CPU = torch.device("cpu")
P = DRAFT_PLACEHOLDER


def test_placeholders_are_read_from_the_drafters_buffer_into_the_drafts_and_input_ids():
    # Requests at batch rows 3 and 1 verify 2 and 3 drafts; the first with ids the scheduler
    # sent (n-gram), the second with placeholders. Step tokens: a plain decode at index 0, then
    # request 11 at 1..3 (newest, d, d), request 12 at 4..7 (newest, d, d, d).
    buffer = DeviceDrafts(max_num_rows=6, num_speculative_tokens=3, device=CPU)
    buffer.record(np.array([1, 3]), torch.tensor([[21, 22, 23], [31, 32, 33]]))
    rows = np.array([0, 3, 1])
    num_drafts = np.array([0, 2, 3])
    verify = verify_rows([10, 11, 12], rows, num_drafts, {11: [8, 9], 12: [P, P, P]}, np.array([0, 1, 4, 8]))
    input_ids = torch.tensor([0, 45, 8, 9, 46, P, P, P])
    drafts = buffer.resolve(verify, input_ids)
    # Row 1's buffer holds 21 22 23: request 12's drafts; request 11 keeps its own ids.
    assert drafts.tolist() == [[8, 9, -1], [21, 22, 23]]
    assert input_ids.tolist() == [0, 45, 8, 9, 46, 21, 22, 23]


def test_drafts_the_scheduler_sent_are_used_as_they_are():
    buffer = DeviceDrafts(max_num_rows=2, num_speculative_tokens=2, device=CPU)
    verify = verify_rows([5], np.array([1]), np.array([2]), {5: [7, 6]}, np.array([0, 3]))
    input_ids = torch.tensor([4, 7, 6])
    assert buffer.resolve(verify, input_ids).tolist() == [[7, 6]]
    assert input_ids.tolist() == [4, 7, 6]


def _new_request(req_id: int, num_tokens: int, num_computed: int) -> NewRequestData:
    params = SamplingParams(temperature=0.0)
    return NewRequestData(
        req_id, None, list(range(num_tokens)), [], params, [0, 1, 2, 3], num_computed, 1, [], 0
    )


def test_the_rejections_of_the_step_before_are_taken_back_from_optimistic_counts():
    batch = InputBatch(4, 8, 50, CPU)
    verifier = DraftVerifier(batch)
    for req_id in (7, 8):
        batch.add_request(_new_request(req_id, 10, 9))
    # The last verifications: request 7 (row 0) rejected 2 of its drafts, request 8 (row 1) none.
    verifier.num_rejected[[batch.row_of[7], batch.row_of[8]]] = [2, 0]
    # The scheduler counted request 7's drafts as accepted: 9 + 1 + 3 = 13 (really 11); request
    # 8's count is exact (its step's output had reached it).
    out = SchedulerOutput()
    out.scheduled_cached_reqs.req_ids = [7, 8]
    out.scheduled_cached_reqs.num_computed_tokens = [13, 12]
    out.scheduled_cached_reqs.block_table_diffs = [None, None]
    out.optimistic_req_ids = {7}
    batch.apply_scheduler_output(out)
    verifier.take_back_rejected(out.optimistic_req_ids)
    assert batch.num_computed_tokens[batch.row_of[7]] == 11
    assert batch.num_computed_tokens[batch.row_of[8]] == 12


@pytest.fixture(params=["torch", "triton"])
def verifier_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The rejection sampler's torch form, or (greedy verifications) the Triton kernel, which runs
    here under Triton's interpreter: the verifier chooses it when the platform has Triton."""
    if request.param == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            pytest.skip("needs CUDA or TRITON_INTERPRET=1")
        with_triton = dataclasses.replace(custom_op.platform_for(CPU), triton=True)
        monkeypatch.setattr(spec_decode, "platform_for", lambda device: with_triton)
    return request.param


def _verification(batch: InputBatch, params: SamplingParams) -> tuple[DraftVerifier, object, torch.Tensor]:
    """Requests 7 (row of 10 tokens, 3 drafts 4 5 6) and 8 (10 tokens, 2 drafts 4 5), greedy
    over a vocabulary of 50: the target's argmax is 4, 5, 9, 9 for request 7 (accepts 2, then
    emits 9) and 9, 9, 9 for request 8 (accepts none, emits 9)."""
    for req_id in (7, 8):
        prompt = list(range(10))
        batch.add_request(NewRequestData(req_id, None, prompt, [], params, [0, 1, 2, 3], 10, 1, [], 0))
    rows = np.array([batch.row_of[7], batch.row_of[8]])
    verify = verify_rows([7, 8], rows, np.array([3, 2]), {7: [4, 5, 6], 8: [4, 5]}, np.array([0, 4, 7]))
    logits = torch.zeros(7, 50)
    logits[torch.arange(7), torch.tensor([4, 5, 9, 9, 9, 9, 9])] = 5.0
    verifier = DraftVerifier(batch)
    return verifier, verifier(logits, verify, torch.tensor([[4, 5, 6], [4, 5, -1]])), rows


def test_a_verification_updates_the_device_at_once_and_the_host_once_when_settled(verifier_kind):
    batch = InputBatch(4, 8, 50, CPU)
    verifier, pending, rows = _verification(batch, SamplingParams(temperature=0.0))
    assert (verifier._greedy_verify is not None) == (verifier_kind == "triton")
    # The device side is done: next inputs 9 and 9, the accepted counts for the drafter.
    assert batch.last_token_ids[rows].tolist() == [9, 9]
    assert pending.num_accepted.tolist() == [2, 0]
    # The host side waits for the next step (or the output): the rows' lengths are unchanged.
    assert batch.num_tokens[rows].tolist() == [10, 10]
    verifier.settle()
    assert batch.num_tokens[rows].tolist() == [13, 11]  # 2 drafts + 9; 9
    assert verifier.num_rejected[rows].tolist() == [1, 2]
    # Once only, whoever asks: the step's output after the next step's start.
    samples = pending.samples()
    verifier.settle()
    assert batch.num_tokens[rows].tolist() == [13, 11]
    assert samples.req_ids == [7, 7, 7, 8] and samples.token_ids == [4, 5, 9, 9]
    assert samples.num_accepted_tokens == {7: 2, 8: 0}


def test_reading_the_samples_leaves_the_batch_to_the_worker_s_thread(verifier_kind):
    """With tensor parallelism a rank's reply thread reads a step's samples while the worker's
    thread plans the next step from the batch: the read must not apply the counts (applying them
    there, a second time or under the planner, moved positions past the blocks on two H200s)."""
    batch = InputBatch(4, 8, 50, CPU)
    verifier, pending, rows = _verification(batch, SamplingParams(temperature=0.0, logprobs=0))
    samples = pending.samples()
    assert batch.num_tokens[rows].tolist() == [10, 10] and verifier.pending
    assert samples.token_ids == [4, 5, 9, 9]
    # logprobs=0: each emitted token's rank and no top tokens, read at the verification.
    assert sorted(samples.top_tokens) == [0, 1, 2, 3]
    assert all(top_ids == [] for _, top_ids, _ in samples.top_tokens.values())
    batch.num_top_tokens[rows] = 5  # the rows moving on after the verification change nothing
    assert pending.samples() is samples
    verifier.settle()
    assert batch.num_tokens[rows].tolist() == [13, 11]


def test_emitted_tokens_count_for_penalties_on_the_device_and_rejected_ones_do_not(verifier_kind):
    batch = InputBatch(4, 8, 50, CPU)
    rows = _verification(batch, SamplingParams(temperature=0.0, frequency_penalty=0.5))[2]
    assert batch.output_counts is not None
    counts = batch.output_counts[rows]
    # Request 7 emitted 4, 5 and 9 (its draft 6 rejected); request 8 emitted 9 alone.
    assert counts[0].nonzero().flatten().tolist() == [4, 5, 9] and counts[0].sum() == 3
    assert counts[1].nonzero().flatten().tolist() == [9] and counts[1].sum() == 1
