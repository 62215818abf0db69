"""Each piece of a step's input building on small hand-made inputs; the whole plan against a naive
loop over the requests' tokens. Expected values are worked out by hand (in the comments) or by
that loop, never by the code under test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pagedllm.sampling_params import SamplingParams
from pagedllm.step_io import NewRequestData, SchedulerOutput
from pagedllm.worker.cuda_graph import CudaGraphRunner
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.input_buffers import InputBuffers, fill_staging
from pagedllm.worker.step_inputs import (
    block_table_width,
    compute_query_start_loc,
    compute_seq_lens,
    compute_slot_mapping,
    decode_query_lens,
    expand_decodes,
    graph_padding,
    host_input_ids,
    max_num_step_seqs,
    order_decodes_first,
    place_drafts,
    plan_step,
    prompt_logprob_rows,
    sample_rows,
    stage_model_input,
    token_positions,
    verify_rows,
)

CPU = torch.device("cpu")
BLOCK_SIZE = 4


def _ints(array: np.ndarray) -> list[int]:
    return np.asarray(array).tolist()


# --- the pieces ---------------------------------------------------------------------------------


def test_order_decodes_first_keeps_each_group_in_order():
    order, num_decodes = order_decodes_first(np.array([3, 1, 5, 1]))
    assert _ints(order) == [1, 3, 0, 2] and num_decodes == 2
    # Already decodes first (all decodes, all prefills): no permutation.
    assert order_decodes_first(np.array([1, 1])) == (None, 2)
    assert order_decodes_first(np.array([4, 2])) == (None, 0)
    order, num_decodes = order_decodes_first(np.array([1, 2]))
    assert _ints(order) == [0, 1] and num_decodes == 1


def test_order_decodes_first_counts_verifying_requests_as_decodes_when_they_expand():
    # A 3-token prefill chunk, a decode, a verification of 2 drafts, a decode with no drafts.
    query_lens, num_drafts = np.array([3, 1, 3, 1]), np.array([0, 0, 2, 0])
    order, num_decodes = order_decodes_first(query_lens, num_drafts)
    assert _ints(order) == [1, 2, 3, 0] and num_decodes == 3
    order, num_decodes = order_decodes_first(query_lens)  # not expanded: a verification is a chunk
    assert _ints(order) == [1, 3, 0, 2] and num_decodes == 2


def test_expand_decodes_makes_a_decode_of_every_token_of_the_first_requests():
    # Decode requests first: a decode (0 drafts) at position 7; a verification of 3 drafts at
    # positions 10..13; a verification of 1 draft at 4..5 behind a window that dropped 4 tokens
    # (cache positions 0..1); then a 3-token prefill chunk at positions 0..2.
    query_start_loc = np.array([0, 1, 5, 7, 10])
    seq_lens = np.array([8, 14, 2, 3], dtype=np.int32)
    seq_index, seq_query_start_loc, seq_seq_lens = expand_decodes(query_start_loc, seq_lens, 3)
    # One sequence per decode token (7 of them), then the chunk, whole.
    assert _ints(seq_index) == [0, 1, 1, 1, 1, 2, 2, 3]
    assert _ints(seq_query_start_loc) == [0, 1, 2, 3, 4, 5, 6, 7, 10]
    # Each token's context ends at its own position: 8; 11, 12, 13, 14; cache positions 1, 2; 3.
    assert _ints(seq_seq_lens) == [8, 11, 12, 13, 14, 1, 2, 3]
    assert seq_seq_lens.dtype == np.int32


def test_decode_query_lens_name_each_verification_at_its_last_decode():
    # The requests of test_expand_decodes_...: a decode, 4 tokens, 2 tokens, then the prefill
    # chunk (not a decode: no entry).
    query_start_loc = np.array([0, 1, 5, 7, 10])
    lens = decode_query_lens(query_start_loc, 3)
    assert _ints(lens) == [1, 0, 0, 0, 4, 0, 2] and lens.dtype == np.int32
    # Each group's sequences are consecutive and end at its last: the expanded seq_lens there
    # are that request's L - q + 1 .. L (paged_decode's query groups).
    _, _, seq_lens = expand_decodes(query_start_loc, np.array([8, 14, 2, 3], dtype=np.int32), 3)
    for last in np.flatnonzero(lens):
        q = lens[last]
        assert _ints(seq_lens[last - q + 1 : last + 1]) == list(
            range(seq_lens[last] - q + 1, seq_lens[last] + 1)
        )
    assert _ints(decode_query_lens(np.array([0, 1, 2, 5]), 2)) == [1, 1]  # lone decodes, then a chunk
    assert _ints(decode_query_lens(np.array([0, 3]), 0)) == []  # no decode


def test_expand_decodes_of_one_token_decodes_only_is_the_identity():
    query_start_loc, seq_lens = np.array([0, 1, 2, 6]), np.array([5, 9, 4], dtype=np.int32)
    seq_index, seq_query_start_loc, seq_seq_lens = expand_decodes(query_start_loc, seq_lens, 2)
    assert _ints(seq_index) == [0, 1, 2]
    assert _ints(seq_query_start_loc) == [0, 1, 2, 6] and _ints(seq_seq_lens) == [5, 9, 4]


def test_max_num_step_seqs_bounds_expanded_sequences_by_requests_and_tokens():
    assert max_num_step_seqs(8, 2048, 0) == 8
    assert max_num_step_seqs(8, 2048, 3) == 32
    assert max_num_step_seqs(256, 512, 3) == 512


def test_query_start_loc_and_seq_lens():
    # Two decodes, a 4-token chunk, a 2-token chunk.
    assert _ints(compute_query_start_loc(np.array([1, 1, 4, 2]))) == [0, 1, 2, 6, 8]
    assert _ints(compute_query_start_loc(np.array([], dtype=np.int64))) == [0]
    # 20 tokens behind a window that dropped 8: the cache holds 12.
    seq_lens = compute_seq_lens(np.array([8, 20]), np.array([0, 8]))
    assert seq_lens.dtype == np.int32 and _ints(seq_lens) == [8, 12]


def test_token_positions_mixed_decodes_and_chunked_prefill():
    # Decodes at 7 and 3; a new prompt's first 4 tokens; a prompt's second chunk from 16.
    starts = np.array([7, 3, 0, 16])
    query_lens = np.array([1, 1, 4, 3])
    positions, req_index = token_positions(starts, query_lens, np.array([0, 1, 2, 6, 9]))
    assert _ints(positions) == [7, 3, 0, 1, 2, 3, 16, 17, 18]
    assert _ints(req_index) == [0, 1, 2, 2, 2, 2, 3, 3, 3]


def test_token_positions_decodes_only_copies_the_starts():
    starts = np.array([5, 9])
    positions, req_index = token_positions(starts, np.array([1, 1]), np.array([0, 1, 2]))
    assert _ints(positions) == [5, 9] and _ints(req_index) == [0, 1]
    positions[0] = -1  # the staged positions may alias the plan's array, never the batch's
    assert _ints(starts) == [5, 9]


def test_slot_mapping_one_table_and_a_row_per_token():
    table = np.array([5, 2, 9], dtype=np.int32)
    # Position 0: block 5 slot 0 -> 20; 3 -> 23; 4: block 2 -> 8; 9: block 9, offset 1 -> 37.
    positions = np.array([0, 3, 4, 9])
    assert _ints(compute_slot_mapping(table, positions, BLOCK_SIZE)) == [20, 23, 8, 37]
    tables = np.array([[5, 2, 9], [1, 6, 0]], dtype=np.int32)[[0, 1, 1, 0]]
    # Rows 0, 1, 1, 0: 20; position 3 of [1, 6] -> 7; 4 -> 24; 9 -> 37.
    slots = compute_slot_mapping(tables, positions, BLOCK_SIZE)
    assert slots.dtype == np.int64 and _ints(slots) == [20, 7, 24, 37]


def test_host_input_ids_reads_host_tokens_and_points_at_device_samples():
    host_token_ids = [
        np.array([10, 11, 12, 13, 14]),  # row 0: a prompt of 5, decoding its own sample
        np.array([30, 31, 32, 33, 34, 35, 36]),  # row 1: resumed, its 7th token a known output
        np.array([20, 21, 22, 23, 24, 25, 26, 27]),  # row 2: a prompt chunked from 3
    ]
    rows = np.array([0, 1, 2])
    starts = np.array([5, 6, 3])
    num_host_tokens = np.array([5, 7, 8])
    input_ids, device_index, device_rows = host_input_ids(
        host_token_ids, rows, starts, num_host_tokens, np.array([0, 1, 2, 4])
    )
    assert _ints(input_ids) == [0, 36, 23, 24]
    assert _ints(device_index) == [0] and _ints(device_rows) == [0]


def test_sample_rows_best_of_repeats_a_row_and_a_short_chunk_samples_nothing():
    # Three requests at batch rows 4, 0, 2: a decode; a chunk ending at 5 of 9 tokens (no sample);
    # a prompt of 10 ending this step that draws best_of = 3 first samples.
    samples = sample_rows(
        rows=np.array([4, 0, 2]),
        ends=np.array([8, 5, 10]),
        num_tokens=np.array([8, 9, 10]),
        num_samples=np.array([1, 1, 3]),
        query_start_loc=np.array([0, 1, 5, 8]),
    )
    assert _ints(samples.sampling_req_rows) == [4, 2]
    assert _ints(samples.sample_rows) == [4, 2, 2, 2]
    assert _ints(samples.first_sample_index) == [0, 1]
    # The last token of each: index 0, and index 7 (of tokens 5..7) three times.
    assert _ints(samples.logits_indices) == [0, 7, 7, 7]


def test_drafts_follow_the_newest_token_and_their_rows_are_verified_not_sampled():
    # Three requests at batch rows 3, 1, 5 (query start 0, 1, 4): a plain decode; a decode of
    # a token the host holds (resent: its 6th of 6) with 2 drafts; a decode of the device's own
    # sample with 3 drafts.
    host_token_ids = [None, np.array([40, 41, 42, 43, 44, 45]), None, np.array([1, 2]), None, np.array([7])]
    rows = np.array([3, 1, 5])
    starts = np.array([2, 5, 4])
    num_drafts = np.array([0, 2, 3])
    query_start_loc = np.array([0, 1, 4, 8])
    input_ids, device_index, device_rows = host_input_ids(
        host_token_ids, rows, starts, np.array([2, 6, 1]), query_start_loc, num_drafts
    )
    # Only the resent request's own token comes from the host: 45 at index 1.
    assert _ints(input_ids) == [0, 45, 0, 0, 0, 0, 0, 0]
    assert _ints(device_index) == [0, 4] and _ints(device_rows) == [3, 5]
    drafts = {11: [8, 9], 12: [5, 6, 7]}
    verify = verify_rows([10, 11, 12], rows, num_drafts, drafts, query_start_loc)
    place_drafts(input_ids, verify, query_start_loc, np.flatnonzero(num_drafts))
    assert _ints(input_ids) == [0, 45, 8, 9, 0, 5, 6, 7]
    assert verify.req_ids == [11, 12] and _ints(verify.rows) == [1, 5]
    assert _ints(verify.draft_token_ids) == [[8, 9, -1], [5, 6, 7]]
    # Every token of a verifying request is scored: indices 1-3 and 4-7.
    assert _ints(verify.logits_indices) == [1, 2, 3, 4, 5, 6, 7]
    # They reach their ends but do not sample: only the plain decode does.
    samples = sample_rows(
        rows, starts + np.array([1, 3, 4]), np.array([3, 6, 5]), np.ones(3, int), query_start_loc, num_drafts
    )
    assert _ints(samples.sampling_req_rows) == [3] and _ints(samples.logits_indices) == [0]


def test_sample_rows_none():
    samples = sample_rows(np.array([1]), np.array([4]), np.array([9]), np.array([1]), np.array([0, 4]))
    assert len(samples.sample_rows) == len(samples.logits_indices) == len(samples.first_sample_index) == 0


def test_prompt_logprob_rows_over_chunks():
    prompt = np.array([100, 101, 102, 103, 104, 105])
    host_token_ids = [prompt, prompt, np.append(prompt, 106), prompt]
    # Row 0 computes tokens 0..3 (first chunk), row 1 4..5 (last chunk), row 2 decodes at 6,
    # row 3 computes 0..1 but did not ask. Tokens at query offsets 0, 4, 6, 7.
    hidden_rows, requests = prompt_logprob_rows(
        req_ids=[7, 8, 9, 10],
        rows=np.array([0, 1, 2, 3]),
        starts=np.array([0, 4, 6, 0]),
        ends=np.array([4, 6, 7, 2]),
        query_start_loc=np.array([0, 4, 6, 7, 9]),
        wants_prompt_logprobs=np.array([True, True, True, False]),
        num_prompt_tokens=np.array([6, 6, 6, 6]),
        host_token_ids=host_token_ids,
    )
    # Row 0: positions 0..3 score tokens 1..4. Row 1: position 4 scores token 5; position 5 is
    # the prompt's last, which scores nothing. Row 2: past the prompt.
    assert hidden_rows == [0, 1, 2, 3, 4]
    assert requests == [(7, 0, [101, 102, 103, 104]), (8, 4, [105])]


def _graph_runner(capture_sizes: list[int]) -> CudaGraphRunner:
    buffers = InputBuffers(16, 8, 4, CPU)
    return CudaGraphRunner(nn.Identity(), buffers, capture_sizes, max_model_len=64)


@pytest.mark.parametrize(
    ("num_reqs", "num_decodes", "expected"),
    [(1, 1, 1), (3, 3, 4), (5, 5, 8), (8, 8, 8), (9, 9, 0), (3, 2, 0)],
)
def test_graph_padding_pads_decodes_only_steps_to_the_next_captured_size(num_reqs, num_decodes, expected):
    assert graph_padding(_graph_runner([1, 2, 4, 8]), num_reqs, num_decodes) == expected
    assert graph_padding(None, num_reqs, num_decodes) == 0


def test_block_table_width():
    assert [block_table_width(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


def test_fill_staging_pads_rows_and_keeps_a_block_table_width():
    host = torch.zeros(6, dtype=torch.int64)
    fill_staging(host, np.array([1, 2, 3]), -1)
    assert host.tolist() == [1, 2, 3, -1, -1, -1]
    tables = torch.full((4, 5), 7, dtype=torch.int32)
    fill_staging(tables, np.array([[1, 2], [3, 4]], dtype=np.int32), 0)
    assert tables.tolist() == [[1, 2, 7, 7, 7], [3, 4, 7, 7, 7], [0] * 5, [0] * 5]


# --- the whole step against a naive loop -------------------------------------------------------


def _new(
    req_id: int, prompt: list[int], block_ids: list[int], outputs: tuple[int, ...] = (), **kwargs
) -> NewRequestData:
    """A new request whose computed tokens the test sets itself."""
    return NewRequestData(
        req_id=req_id,
        seed=None,
        prompt_token_ids=prompt,
        output_token_ids=list(outputs),
        sampling_params=SamplingParams(max_tokens=16, prompt_logprobs=kwargs.get("prompt_logprobs")),
        block_ids=block_ids,
        num_computed_tokens=0,
        num_samples=kwargs.get("num_samples", 1),
        min_tokens_stop_ids=[],
        num_top_tokens=0,
    )


def _mixed_batch() -> InputBatch:
    """Four requests, one of each kind a step mixes (block size 4):

    10: a prompt of 5 computed, decoding its first sample, which only the device has (777);
    11: a prompt of 10 whose first chunk of 4 is computed;
    12: a new prompt of 3 that asks for prompt logprobs and draws best_of = 2 first samples;
    13: a resumed request (12 prompt tokens and one known output, 99) behind a sliding window
        that dropped its first 8 tokens' blocks: its table starts at cache position 0 = 8.
    """
    batch = InputBatch(8, 8, 1000, CPU)
    out = SchedulerOutput(
        scheduled_new_reqs=[
            _new(10, [1, 2, 3, 4, 5], [3, 7]),
            _new(11, list(range(20, 30)), [1, 2, 5]),
            _new(12, [40, 41, 42], [6], prompt_logprobs=1, num_samples=2),
            _new(13, list(range(50, 62)), [4, 9], outputs=(99,)),
        ],
        num_dropped_tokens={13: 8},
    )
    batch.apply_scheduler_output(out)
    batch.num_computed_tokens[batch.row_of[10]] = 5
    batch.num_computed_tokens[batch.row_of[11]] = 4
    batch.num_computed_tokens[batch.row_of[12]] = 0
    batch.num_computed_tokens[batch.row_of[13]] = 12
    row = np.array([batch.row_of[10]])
    batch.record_samples(row, torch.tensor([0]), torch.tensor([777]))
    return batch


def _naive_plan(
    batch: InputBatch, num_scheduled: dict[int, int], drafts: dict[int, list[int]] | None = None
) -> dict:
    """The step token by token, decodes first; with ``drafts``, verifying requests expanded: a
    decode sequence per token, each over its own context (batch expansion)."""
    drafts = drafts or {}
    order = [r for r, n in num_scheduled.items() if n == 1 or r in drafts]
    order += [r for r in num_scheduled if r not in order]
    plan: dict = {k: [] for k in ("positions", "slots", "input_ids", "device", "seq_lens", "qsl", "seq_rows")}
    plan.update(sample_rows=[], logits=[], verify=[], prompt_rows=[], prompt_requests=[])
    token = 0
    for req_id in order:
        row = batch.row_of[req_id]
        start = int(batch.num_computed_tokens[row])
        dropped = int(batch.num_dropped_tokens[row])
        host = batch.host_token_ids[row]
        request_drafts = drafts.get(req_id, [])
        num_tokens = num_scheduled[req_id]
        expanded = num_tokens == 1 or bool(request_drafts)
        if not expanded:
            plan["qsl"].append(token)
            plan["seq_rows"].append(row)
        targets = []
        for j, position in enumerate(range(start, start + num_tokens)):
            cache_position = position - dropped
            block = batch.block_table[row][cache_position // BLOCK_SIZE]
            plan["positions"].append(position)
            plan["slots"].append(int(block) * BLOCK_SIZE + cache_position % BLOCK_SIZE)
            if expanded:  # its own sequence: a query at cache_position over the tokens up to it
                plan["qsl"].append(token)
                plan["seq_rows"].append(row)
                plan["seq_lens"].append(cache_position + 1)
            if j >= num_tokens - len(request_drafts):
                plan["input_ids"].append(request_drafts[j - num_tokens + len(request_drafts)])
            elif position < len(host):
                plan["input_ids"].append(int(host[position]))
            else:
                plan["input_ids"].append(0)
                plan["device"].append((token, row))
            if batch.params[row].prompt_logprobs is not None and position + 1 < batch.num_prompt_tokens[row]:
                plan["prompt_rows"].append(token)
                targets.append(int(host[position + 1]))
            if request_drafts:
                plan["verify"].append(token)
            token += 1
        end = start + num_tokens
        if not expanded:
            plan["seq_lens"].append(end - dropped)
        if end >= batch.num_tokens[row] and not request_drafts:
            plan["sample_rows"] += [row] * int(batch.num_samples[row])
            plan["logits"] += [token - 1] * int(batch.num_samples[row])
        if targets:
            plan["prompt_requests"].append((req_id, start, targets))
    plan["qsl"].append(token)
    return plan


def test_plan_step_mixed_batch_against_a_naive_loop():
    batch = _mixed_batch()
    num_scheduled = {11: 4, 10: 1, 12: 3, 13: 1}
    plan = plan_step(batch, num_scheduled, BLOCK_SIZE, graph_runner=None)
    naive = _naive_plan(batch, num_scheduled)
    assert _ints(plan.rows) == [batch.row_of[r] for r in (10, 13, 11, 12)]
    assert plan.num_decodes == 2 and plan.max_query_len == 4
    assert _ints(plan.positions) == naive["positions"] == [5, 12, 4, 5, 6, 7, 0, 1, 2]
    # Request 13's position 12 is cache position 4: its table's second block (9), slot 36.
    assert _ints(plan.slot_mapping) == naive["slots"]
    assert plan.slot_mapping[1] == 9 * BLOCK_SIZE
    assert _ints(plan.input_ids) == naive["input_ids"] == [0, 99, 24, 25, 26, 27, 40, 41, 42]
    assert list(zip(_ints(plan.device_input_index), _ints(plan.device_input_rows))) == naive["device"]
    assert _ints(plan.query_start_loc) == naive["qsl"] == [0, 1, 2, 6, 9]
    assert _ints(plan.seq_lens) == naive["seq_lens"] == [6, 5, 8, 3]
    # Samples: 10 once, 13 once, 12 twice (best_of); 11's chunk is short of its prompt.
    assert _ints(plan.samples.sample_rows) == naive["sample_rows"]
    assert plan.sample_req_ids == [10, 13, 12, 12]
    assert _ints(plan.samples.first_sample_index) == [0, 1, 2]
    assert _ints(plan.logits_indices) == naive["logits"] + naive["prompt_rows"] == [0, 1, 8, 8, 6, 7]
    assert plan.prompt_logprob_requests == naive["prompt_requests"] == [(12, 0, [41, 42])]
    assert plan.pad_to == 0


def test_plan_step_decodes_only_pads_to_the_graph_size():
    batch = _mixed_batch()
    num_scheduled = {13: 1, 10: 1}
    plan = plan_step(batch, num_scheduled, BLOCK_SIZE, _graph_runner([1, 4]))
    naive = _naive_plan(batch, num_scheduled)
    assert _ints(plan.positions) == naive["positions"] and _ints(plan.slot_mapping) == naive["slots"]
    assert len(plan.rows) == 2 and plan.pad_to == 4
    # The padding rows are one-token decodes: query offsets run on to the graph's size.
    assert _ints(plan.query_start_loc) == [0, 1, 2, 3, 4]
    assert _ints(plan.seq_lens) == naive["seq_lens"]
    staged = stage_model_input(plan, batch, InputBuffers(16, 8, 8, CPU), BLOCK_SIZE)
    assert staged.graph_num_seqs == 2 and staged.input_ids.tolist() == [99, 777]


def test_plan_step_expands_verifications_into_decodes_against_a_naive_loop():
    """Request 10 verifies 2 drafts at positions 5..7, request 13 (behind its window) 1 draft at
    12..13, beside a prefill chunk (11) and a new prompt (12): the verifications become five
    decode sequences; tokens, slots and scored rows are those of the unexpanded plan."""
    batch = _mixed_batch()
    drafts = {10: [70, 71], 13: [80]}
    num_scheduled = {11: 4, 10: 3, 12: 3, 13: 2}
    plan = plan_step(batch, num_scheduled, BLOCK_SIZE, None, drafts, expand_verify=3)
    naive = _naive_plan(batch, num_scheduled, drafts)
    assert _ints(plan.rows) == [batch.row_of[r] for r in (10, 13, 11, 12)]
    assert _ints(plan.req_query_start_loc) == [0, 3, 5, 9, 12]
    assert _ints(plan.positions) == naive["positions"] == [5, 6, 7, 12, 13, 4, 5, 6, 7, 0, 1, 2]
    assert _ints(plan.slot_mapping) == naive["slots"]
    assert _ints(plan.input_ids) == naive["input_ids"] == [0, 70, 71, 99, 80, 24, 25, 26, 27, 40, 41, 42]
    assert list(zip(_ints(plan.device_input_index), _ints(plan.device_input_rows))) == naive["device"]
    # Attention's sequences: five decodes (each token of 10 and 13), then the two chunks.
    assert plan.num_decodes == 5 and plan.max_query_len == 4
    assert _ints(plan.seq_rows) == naive["seq_rows"]
    assert _ints(plan.query_start_loc) == naive["qsl"] == [0, 1, 2, 3, 4, 5, 9, 12]
    # 10's tokens see 6, 7, 8 tokens; 13's cache positions 4 and 5 see 5 and 6.
    assert _ints(plan.seq_lens) == naive["seq_lens"] == [6, 7, 8, 5, 6, 8, 3]
    # Scored rows: 12's best_of samples, then every token of 10 and 13, then 12's prompt rows.
    assert _ints(plan.logits_indices) == naive["logits"] + naive["verify"] + naive["prompt_rows"]
    assert _ints(plan.verify.logits_indices) == naive["verify"] == [0, 1, 2, 3, 4]
    assert plan.verify.req_ids == [10, 13] and plan.pad_to == 0
    # The unexpanded plan (verifications as prefill chunks, after 11's) scores the same tokens,
    # in the same order: rows score the same positions of the same inputs.
    plain = plan_step(batch, num_scheduled, BLOCK_SIZE, None, drafts)
    assert plain.num_decodes == 0 and _ints(plain.query_start_loc) == [0, 4, 7, 10, 12]
    for name in ("positions", "input_ids"):
        scored = _ints(getattr(plan, name)[plan.logits_indices])
        assert scored == _ints(getattr(plain, name)[plain.logits_indices]), name
    assert _ints(plan.positions[plan.logits_indices]) == [2, 2, 5, 6, 7, 12, 13, 0, 1]
    model_input = stage_model_input(plan, batch, InputBuffers(16, 8, 8, CPU), BLOCK_SIZE)
    metadata = model_input.attn_metadata
    assert (metadata.num_decodes, metadata.num_prefills, metadata.min_decode_seq_len) == (5, 2, 5)
    # Each sequence reads its request's block table row: 10's three times, 13's twice.
    assert metadata.block_tables.tolist() == [[3, 7]] * 3 + [[4, 9]] * 2 + [[1, 2], [6, 0]]
    # Query groups: the last of 10's three decodes attends for them, the last of 13's two.
    assert metadata.decode_query_lens.tolist() == [0, 0, 3, 0, 2] and metadata.max_decode_query_len == 3
    assert plain.decode_query_lens is None and plain.max_decode_query_len == 1
    assert model_input.input_ids.tolist()[:5] == [777, 70, 71, 99, 80]
    assert _ints(model_input.req_query_start_loc) == [0, 3, 5, 9, 12]


def test_a_step_of_decodes_and_verifications_replays_the_graph_of_its_token_count():
    batch = _mixed_batch()
    drafts = {10: [70, 71], 13: [80]}
    plan = plan_step(batch, {13: 2, 10: 3}, BLOCK_SIZE, _graph_runner([1, 4, 8]), drafts, expand_verify=4)
    # 13 stays first (both are decodes now): its two tokens, then 10's three; padded to 8.
    assert plan.num_decodes == 5 and plan.pad_to == 8
    assert _ints(plan.decode_query_lens) == [0, 2, 0, 0, 3] and plan.max_decode_query_len == 4
    assert _ints(plan.query_start_loc) == list(range(9))
    assert _ints(plan.seq_lens) == [5, 6, 6, 7, 8]
    staged = stage_model_input(plan, batch, InputBuffers(16, 8, 8, CPU), BLOCK_SIZE)
    assert staged.graph_num_seqs == 5 and staged.input_ids.tolist() == [99, 80, 777, 70, 71]
    # Unexpanded, the verifications are prefill chunks: eager.
    assert plan_step(batch, {13: 2, 10: 3}, BLOCK_SIZE, _graph_runner([1, 4, 8]), drafts).pad_to == 0


def test_stage_model_input_on_the_cpu():
    batch = _mixed_batch()
    num_scheduled = {11: 4, 10: 1, 12: 3, 13: 1}
    plan = plan_step(batch, num_scheduled, BLOCK_SIZE, graph_runner=None)
    model_input = stage_model_input(plan, batch, InputBuffers(16, 8, 8, CPU), BLOCK_SIZE)
    # Request 10's input is its sample, read from last_token_ids.
    assert model_input.input_ids.tolist() == [777, 99, 24, 25, 26, 27, 40, 41, 42]
    assert model_input.positions.tolist() == _ints(plan.positions)
    assert model_input.logits_indices.tolist() == [0, 1, 8, 8, 6, 7]
    metadata = model_input.attn_metadata
    assert (metadata.num_decodes, metadata.num_prefills) == (2, 2)
    assert (metadata.max_query_len, metadata.max_seq_len, metadata.min_decode_seq_len) == (4, 8, 5)
    assert metadata.slot_mapping.tolist() == _ints(plan.slot_mapping)
    assert metadata.query_start_loc.tolist() == metadata.query_start_loc_cpu.tolist() == [0, 1, 2, 6, 9]
    assert metadata.seq_lens.tolist() == metadata.seq_lens_cpu.tolist() == [6, 5, 8, 3]
    # Block tables: the rows of 10, 13, 11, 12, two columns (the longest context, 8, in blocks of 4).
    assert metadata.block_tables.tolist() == [[3, 7], [4, 9], [1, 2], [6, 0]]
    assert model_input.sample_req_ids == [10, 13, 12, 12]
    assert _ints(model_input.sampling_req_rows) == [batch.row_of[r] for r in (10, 13, 12)]
    assert model_input.prompt_logprob_requests == [(12, 0, [41, 42])]
    assert model_input.graph_num_seqs is None


def test_state_slots_follow_the_requests_in_batch_order():
    """A hybrid model's state rows, staged decodes first as the requests are; None otherwise."""
    batch = _mixed_batch()
    for req_id, slot in {10: 3, 11: 0, 12: 2, 13: 1}.items():
        batch.state_slots[batch.row_of[req_id]] = slot
    num_scheduled = {11: 4, 10: 1, 12: 3, 13: 1}
    plan = plan_step(batch, num_scheduled, BLOCK_SIZE, graph_runner=None)
    buffers = InputBuffers(16, 8, 8, CPU)
    staged = stage_model_input(plan, batch, buffers, BLOCK_SIZE, has_state=True)
    assert staged.attn_metadata.state_slots.tolist() == [3, 1, 0, 2]  # requests 10, 13, 11, 12
    assert stage_model_input(plan, batch, buffers, BLOCK_SIZE).attn_metadata.state_slots is None
