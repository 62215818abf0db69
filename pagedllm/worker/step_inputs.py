"""One step's model inputs, built from the persistent batch in two halves: a host plan, then staging.

``plan_step`` flattens the scheduled requests into one batch (CSR offsets, as the attention
backends read it) with vectorised index arithmetic over the requests; every piece is a pure numpy
function of per-request arrays, tested on its own (tests/worker/test_step_inputs.py):

- ``order_decodes_first``: requests with one new token go first, so that a backend can run them
  through a decode kernel and a step of decodes only can replay a captured CUDA graph;
- ``expand_decodes``: batch expansion (speculative decoding): a request verifying k drafts, its
  newest token and the drafts at positions p .. p + k, goes to attention as k + 1 decode sequences,
  sequence i a query at p + i over a context of p + i + 1 tokens through the request's block table.
  A step writes every token's K/V into the cache before attention reads it, so sequence i sees
  the K/V of tokens p .. p + i - 1 of the same step: causal attention within the verified tokens,
  exactly as a prefill chunk computes it. A step of decodes and verifications is then a decode step
  of sum(k + 1) sequences, which replays a captured CUDA graph (Leviathan et al. 2023's parallel
  scoring; vLLM v0's "batch expansion" scorer). Hidden states stay in token order: only
  attention's sequences change, not the tokens, their positions, slots or scored rows;
- ``compute_query_start_loc``, ``compute_seq_lens``: the CSR offsets of each request's new tokens,
  and its context length after the step as the cache holds it;
- ``token_positions``: each token's position and its request's index in the step;
- ``compute_slot_mapping``: the cache slot each token writes. Behind a sliding window a request's
  table has lost the blocks of its first ``num_dropped`` tokens, so attention reads cache
  positions (position - num_dropped) while the rotary embedding takes the positions themselves.
  With context parallelism a rank writes only its stripe of the positions (every P-th);
- ``host_input_ids``: the tokens the host has; a decoding request's newest sample was drawn on the
  device and never came back, so its input is read from ``InputBatch.last_token_ids`` there;
- ``sample_rows``, ``verify_rows``, ``prompt_logprob_rows``: which hidden-state rows the step
  scores (``logits_indices``): the last token of each request that reaches its end (a best_of
  request's first samples repeat its row), then every row of a request verifying drafts
  (speculative decoding: its newest token and each draft, whose logits score the draft after it),
  then each prompt token a request asked logprobs for;
- ``graph_padding``: a step of decodes only is padded to the next captured graph's batch size.

Requests and attention's sequences differ only under batch expansion: ``StepPlan.rows`` and
``req_query_start_loc`` are the requests', ``seq_rows``, ``query_start_loc``, ``seq_lens``,
``num_decodes`` and ``max_query_len`` attention's.

``stage_model_input`` then writes the plan into ``InputBuffers``: on a GPU each array costs one
asynchronous copy from pinned memory into a tensor at a fixed address (no allocation, no host
sync, and what a captured graph reads), and the block tables and device-held decode inputs are
gathered on the device. On the CPU the arrays are used as they are. The split keeps every index
computation testable on plain arrays, and every device write in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.worker.cuda_graph import CudaGraphRunner
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.input_buffers import InputBuffers, to_device


@dataclass
class ModelInput:
    """One forward pass's inputs and which rows of its hidden states to score."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    # [num_sample_rows + num_prompt_rows] int64: the hidden-state row of each sample to draw (a row
    # repeats when a request draws several first tokens), then of each prompt logprob to score.
    logits_indices: torch.Tensor
    # Per sample row: its request's id and batch row; and per sampling request, its batch row and
    # where its first sample row is.
    sample_req_ids: list[int]
    sample_rows: np.ndarray
    sampling_req_rows: np.ndarray
    first_sample_index: np.ndarray
    # Prompt logprobs: (req_id, first position, target token ids), rows after the verify rows.
    prompt_logprob_requests: list[tuple[int, int, list[int]]] = field(default_factory=list)
    # Set when the step replays a captured CUDA graph (all decodes): the real batch size.
    graph_num_seqs: int | None = None
    # Requests verifying drafts, whose rows follow the sample rows; None when there are none.
    verify: VerifyRows | None = None
    # [num_reqs] the batch row of each request, in step order, and [num_reqs + 1] the CSR offsets
    # of their tokens (an EAGLE head's inputs need them; attention's sequences may split a request).
    req_rows: np.ndarray | None = None
    req_query_start_loc: np.ndarray | None = None

    @property
    def num_verify_rows(self) -> int:
        return 0 if self.verify is None else len(self.verify.logits_indices)


@dataclass
class SampleRows:
    """The rows a step samples: one per sample drawn, grouped by request."""

    sampling_req_rows: np.ndarray  # [num_sampling_reqs] batch row of each request that samples
    sample_rows: np.ndarray  # [num_sample_rows] batch row of each sample row
    first_sample_index: np.ndarray  # [num_sampling_reqs] its first sample row's index
    logits_indices: np.ndarray  # [num_sample_rows] hidden-state row (token index) of each sample


@dataclass
class VerifyRows:
    """The requests verifying drafts in a step, in batch order: each one's last ``k + 1`` tokens
    (its newest token, then its ``k`` drafts) are scored, and the logits of token j judge draft j
    (the last row gives the token after every draft)."""

    req_ids: list[int]
    rows: np.ndarray  # [num_verify_reqs] batch row of each
    num_drafts: np.ndarray  # [num_verify_reqs] int64: k of each
    draft_token_ids: np.ndarray  # [num_verify_reqs, max k] int64, -1 past a request's drafts
    logits_indices: np.ndarray  # [sum(k + 1)] int64 hidden-state rows, request by request


@dataclass
class StepPlan:
    """A step's inputs on the host, in batch order (decodes first). Arrays of tokens are
    [num_tokens], of requests [num_reqs], of attention's sequences [num_seqs] (the requests, but
    one per token of a request expanded into decodes: ``expand_decodes``), unpadded except
    ``query_start_loc`` under a graph."""

    rows: np.ndarray  # batch row of each request
    req_query_start_loc: np.ndarray  # int64 [num_reqs + 1]: CSR offsets of each request's tokens
    seq_rows: np.ndarray  # batch row of each sequence (its request's)
    num_decodes: int  # sequences of one query token, first
    max_query_len: int
    input_ids: np.ndarray  # int64, 0 where the device holds the token
    device_input_index: np.ndarray  # token index of each input read from last_token_ids
    device_input_rows: np.ndarray  # ... and the batch row it is read from
    positions: np.ndarray  # int64
    slot_mapping: np.ndarray  # int64
    query_start_loc: np.ndarray  # int32 [num_seqs + 1], or [pad_to + 1] when a graph replays
    seq_lens: np.ndarray  # int32 [num_seqs]
    logits_indices: np.ndarray  # int64: sample rows, then prompt logprob rows
    samples: SampleRows
    sample_req_ids: list[int]
    prompt_logprob_requests: list[tuple[int, int, list[int]]]
    pad_to: int  # rows of the captured graph's batch size the step replays, 0 when eager
    state_slots: np.ndarray  # int64 recurrent-state row of each sequence (-1: none)
    verify: VerifyRows | None = None
    # int32 [num_decodes] with expanded verifications (decode_query_lens), else None; its bound.
    decode_query_lens: np.ndarray | None = None
    max_decode_query_len: int = 1


# --- the pieces: pure functions of per-request arrays ------------------------------------------


def order_decodes_first(
    query_lens: np.ndarray, num_drafts: np.ndarray | None = None
) -> tuple[np.ndarray | None, int]:
    """query_lens: [num_reqs] new tokens per request; num_drafts: [num_reqs] drafts among them
    when verifying requests are expanded into decodes (``expand_decodes``), else None. Returns the
    permutation that puts the decodes (one new token, or drafts to verify) first, each group in
    its own order (None when all are decodes or none is), and the number of decode requests."""
    is_decode = query_lens == 1
    if num_drafts is not None:
        is_decode |= num_drafts > 0
    num_decodes = int(is_decode.sum())
    if 0 < num_decodes < len(query_lens):
        return np.concatenate([np.flatnonzero(is_decode), np.flatnonzero(~is_decode)]), num_decodes
    return None, num_decodes


def compute_query_start_loc(query_lens: np.ndarray) -> np.ndarray:
    """[num_reqs + 1] int64: where each request's tokens start in the flattened batch, then the
    total (CSR offsets)."""
    query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    return query_start_loc


def expand_decodes(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, num_decode_reqs: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch expansion: every token of the first ``num_decode_reqs`` requests becomes a decode
    sequence (see the module docstring); the requests after them stay one sequence each.

    query_start_loc: [num_reqs + 1] the requests' CSR offsets; seq_lens: [num_reqs] their contexts
    after the step. Returns ``(seq_index, query_start_loc, seq_lens)`` of the sequences: each
    one's request (whose block table row it reads), [num_seqs + 1] offsets and [num_seqs] contexts.
    Token t of request r is its query's (end_r - 1 - t)-th token from the last, so its context
    ends that many tokens before r's::

        request r: 3 tokens at positions 7, 8, 9 (seq_len 10)  ->  3 sequences, seq_lens 8, 9, 10
    """
    num_reqs = len(seq_lens)
    num_decode_tokens = int(query_start_loc[num_decode_reqs])
    if num_decode_tokens == num_decode_reqs:  # one token each: the sequences are the requests
        return np.arange(num_reqs), query_start_loc, seq_lens
    token_req = np.repeat(np.arange(num_decode_reqs), np.diff(query_start_loc[: num_decode_reqs + 1]))
    tokens_after = query_start_loc[1:][token_req] - 1 - np.arange(num_decode_tokens)
    decode_seq_lens = (seq_lens[token_req] - tokens_after).astype(seq_lens.dtype)
    return (
        np.concatenate([token_req, np.arange(num_decode_reqs, num_reqs)]),
        np.concatenate([np.arange(num_decode_tokens), query_start_loc[num_decode_reqs:]]),
        np.concatenate([decode_seq_lens, seq_lens[num_decode_reqs:]]),
    )


def decode_query_lens(query_start_loc: np.ndarray, num_decode_reqs: int) -> np.ndarray:
    """[num_decode_tokens] int32: the query groups of expanded decodes (AttentionMetadata's
    ``decode_query_lens``): at each decode request's last token its number of tokens, 0 at its
    others::

        requests of 1, 3 and 2 tokens  ->  [1, 0, 0, 3, 0, 2]
    """
    ends = query_start_loc[1 : num_decode_reqs + 1]
    lens = np.zeros(int(query_start_loc[num_decode_reqs]), dtype=np.int32)
    lens[ends - 1] = np.diff(query_start_loc[: num_decode_reqs + 1])
    return lens


def compute_seq_lens(ends: np.ndarray, num_dropped: np.ndarray) -> np.ndarray:
    """[num_reqs] int32: each request's context after the step as the cache holds it, its tokens
    less those whose blocks a sliding window dropped."""
    return (ends - num_dropped).astype(np.int32)


def token_positions(
    starts: np.ndarray, query_lens: np.ndarray, query_start_loc: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """starts: [num_reqs] tokens computed before the step. Returns [num_tokens] int64 arrays: each
    token's position in its sequence, and its request's index in the step."""
    num_reqs = len(starts)
    num_tokens = int(query_start_loc[-1])
    if num_tokens == num_reqs:  # decodes only: one token per request at its start
        return starts.copy(), np.arange(num_reqs)
    req_index = np.repeat(np.arange(num_reqs), query_lens)
    # Token i of the batch sits at position start + (i - query_start) of its request.
    positions = np.repeat(starts - query_start_loc[:-1], query_lens) + np.arange(num_tokens)
    return positions, req_index


def compute_slot_mapping(
    block_table: np.ndarray, positions: np.ndarray, block_size: int, stripe: tuple[int, int] = (0, 1)
) -> np.ndarray:
    """Cache slot of each position: block_table[pos // block_size] * block_size + pos % block_size.
    block_table: [num_tokens, width] (each token's request's row) or [width] (one request).

    ``stripe = (r, P)``: context parallelism over P ranks, this one r, whose cache holds the
    positions ``pos % P == r`` at local index ``pos // P`` (a block of the scheduler's, block_size
    x P positions, is one block_size block on every rank); the other positions get -1, written
    by another rank."""
    rank, size = stripe
    local = positions if size == 1 else positions // size
    blocks = (
        np.take_along_axis(block_table, (local // block_size)[:, None], axis=-1)[:, 0]
        if (block_table.ndim == 2)
        else block_table[local // block_size]
    )
    slots = blocks.astype(np.int64) * block_size + local % block_size
    return slots if size == 1 else np.where(positions % size == rank, slots, -1)


def host_input_ids(
    host_token_ids: list[np.ndarray | None],
    rows: np.ndarray,
    starts: np.ndarray,
    num_host_tokens: np.ndarray,
    query_start_loc: np.ndarray,
    num_drafts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """host_token_ids: per batch row, the tokens the host sent; num_host_tokens: [num_reqs] how
    many. Returns input_ids [num_tokens] int64, each request's scheduled tokens where the host
    has them; and for each request whose input the host lacks (a decode of the worker's own last
    sample, left 0 in input_ids), its token's index and its batch row, where the device reads it.
    num_drafts: [num_reqs] drafts scheduled last in each request's tokens (``place_drafts``
    writes them), or None."""
    input_ids = np.zeros(int(query_start_loc[-1]), dtype=np.int64)
    from_host = starts < num_host_tokens
    for i in np.flatnonzero(from_host).tolist():
        begin, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if num_drafts is not None:
            end -= int(num_drafts[i])
        tokens = host_token_ids[int(rows[i])]
        assert tokens is not None
        input_ids[begin:end] = tokens[int(starts[i]) : int(starts[i]) + end - begin]
    from_device = ~from_host
    return input_ids, query_start_loc[:-1][from_device], rows[from_device]


def sample_rows(
    rows: np.ndarray,
    ends: np.ndarray,
    num_tokens: np.ndarray,
    num_samples: np.ndarray,
    query_start_loc: np.ndarray,
    num_drafts: np.ndarray | None = None,
) -> SampleRows:
    """rows, ends, num_tokens, num_samples: [num_reqs] batch row, tokens after the step, tokens the
    request has, samples it draws. A request samples when the step reaches its last token (a
    prefill chunk short of it does not); a best_of request draws its first num_samples tokens from
    the same hidden row, repeated. Requests with drafts (num_drafts > 0) verify instead
    (``verify_rows``)."""
    reaches_end = ends >= num_tokens
    if num_drafts is not None:
        reaches_end &= num_drafts == 0
    sampling_idx = np.flatnonzero(reaches_end)
    repeats = num_samples[sampling_idx]
    first_sample_index = np.zeros(len(sampling_idx), dtype=np.int64)
    np.cumsum(repeats[:-1], out=first_sample_index[1:])
    return SampleRows(
        sampling_req_rows=rows[sampling_idx],
        sample_rows=np.repeat(rows[sampling_idx], repeats),
        first_sample_index=first_sample_index,
        logits_indices=np.repeat(query_start_loc[1:][sampling_idx] - 1, repeats),
    )


def verify_rows(
    req_ids: list[int],
    rows: np.ndarray,
    num_drafts: np.ndarray,
    drafts: dict[int, list[int]],
    query_start_loc: np.ndarray,
) -> VerifyRows:
    """rows, num_drafts: [num_reqs]; drafts: req_id -> its draft tokens. The rows of the requests
    with drafts (see ``VerifyRows``)."""
    index = np.flatnonzero(num_drafts)
    counts = num_drafts[index]
    verify_ids = [req_ids[i] for i in index.tolist()]
    draft_token_ids = np.full((len(index), int(counts.max())), -1, dtype=np.int64)
    for i, req_id in enumerate(verify_ids):
        draft_token_ids[i, : counts[i]] = drafts[req_id]
    # Request i's last k_i + 1 tokens end at query_start_loc[i + 1].
    num_rows = counts + 1
    first = np.repeat(query_start_loc[1:][index] - num_rows, num_rows)
    offsets = np.arange(int(num_rows.sum())) - np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
    return VerifyRows(verify_ids, rows[index], counts, draft_token_ids, first + offsets)


def place_drafts(
    input_ids: np.ndarray, verify: VerifyRows, query_start_loc: np.ndarray, index: np.ndarray
) -> None:
    """Write each verifying request's drafts into its last input positions (after its newest
    token). index: [num_verify_reqs] the requests' places in the step."""
    for i, (k, end) in enumerate(zip(verify.num_drafts.tolist(), query_start_loc[1:][index].tolist())):
        input_ids[end - k : end] = verify.draft_token_ids[i, :k]


def prompt_logprob_rows(
    req_ids: list[int],
    rows: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    query_start_loc: np.ndarray,
    wants_prompt_logprobs: np.ndarray,
    num_prompt_tokens: np.ndarray,
    host_token_ids: list[np.ndarray | None],
) -> tuple[list[int], list[tuple[int, int, list[int]]]]:
    """For the requests (arrays [num_reqs]) that asked for prompt logprobs, the hidden rows that
    score their prompt tokens (the row of position p scores prompt token p + 1, so a prompt's last
    token scores none) and (req_id, first position, target token ids) per request with any."""
    hidden_rows: list[int] = []
    requests: list[tuple[int, int, list[int]]] = []
    for i in np.flatnonzero(wants_prompt_logprobs).tolist():
        start = int(starts[i])
        end = min(int(ends[i]), int(num_prompt_tokens[i]) - 1)
        if end <= start:
            continue
        hidden_rows += range(int(query_start_loc[i]), int(query_start_loc[i]) + end - start)
        tokens = host_token_ids[int(rows[i])]
        assert tokens is not None
        requests.append((req_ids[i], start, tokens[start + 1 : end + 1].tolist()))
    return hidden_rows, requests


def graph_padding(graph_runner: CudaGraphRunner | None, num_seqs: int, num_decodes: int) -> int:
    """The batch size of the captured graph a step replays: decodes only, no more than the
    largest graph; 0 when the step runs eagerly."""
    if graph_runner is None or num_decodes != num_seqs or num_seqs > graph_runner.max_batch_size:
        return 0
    return graph_runner.padded_size(num_seqs)


def max_num_step_seqs(max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int) -> int:
    """The most sequences a step's attention holds: ``max_num_seqs`` requests, each expanded into
    ``num_speculative_tokens + 1`` decodes (0 without speculation), and no more than its tokens."""
    return min(max_num_seqs * (num_speculative_tokens + 1), max_num_batched_tokens)


def block_table_width(max_seq_len: int, block_size: int) -> int:
    """Columns of the block table a step's longest context reads."""
    return -(-max_seq_len // block_size)


# --- the step ---------------------------------------------------------------------------------


def plan_step(
    batch: InputBatch,
    num_scheduled_tokens: dict[int, int],
    block_size: int,
    graph_runner: CudaGraphRunner | None,
    drafts: dict[int, list[int]] | None = None,
    expand_verify: int = 0,
    stripe: tuple[int, int] = (0, 1),
) -> StepPlan:
    """The step's inputs on the host, from the persistent batch (already updated for the step),
    the tokens scheduled per request and the drafts among them (speculative decoding);
    ``expand_verify`` (chosen once by the runner: num_speculative_tokens + 1, the most tokens a
    request verifies, or 0): requests verifying drafts go to attention as decodes, one per token
    (``expand_decodes``), in query groups (``decode_query_lens``); ``stripe``: this rank's share of
    the cache under context parallelism (``compute_slot_mapping``)."""
    req_ids = list(num_scheduled_tokens)
    query_lens = np.fromiter(num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
    rows = np.fromiter((batch.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
    num_drafts = (
        np.fromiter((len(drafts.get(r, ())) for r in req_ids), dtype=np.int64, count=len(req_ids))
        if drafts
        else None
    )
    order, num_decode_reqs = order_decodes_first(query_lens, num_drafts if expand_verify else None)
    if order is not None:
        rows, query_lens = rows[order], query_lens[order]
        req_ids = [req_ids[i] for i in order.tolist()]
        num_drafts = None if num_drafts is None else num_drafts[order]
    starts = batch.num_computed_tokens[rows]
    ends = starts + query_lens
    num_dropped = batch.num_dropped_tokens[rows]
    query_start_loc = compute_query_start_loc(query_lens)
    positions, req_index = token_positions(starts, query_lens, query_start_loc)
    # Attention writes and reads cache positions; the rotary embedding takes the positions.
    slot_mapping = compute_slot_mapping(
        batch.block_table[rows[req_index]], positions - num_dropped[req_index], block_size, stripe
    )
    input_ids, device_input_index, device_input_rows = host_input_ids(
        batch.host_token_ids, rows, starts, batch.num_host_tokens[rows], query_start_loc, num_drafts
    )
    samples = sample_rows(
        rows, ends, batch.num_tokens[rows], batch.num_samples[rows], query_start_loc, num_drafts
    )
    verify = None
    if num_drafts is not None:
        verify = verify_rows(req_ids, rows, num_drafts, drafts, query_start_loc)
        place_drafts(input_ids, verify, query_start_loc, np.flatnonzero(num_drafts))
    prompt_rows, prompt_requests = prompt_logprob_rows(
        req_ids,
        rows,
        starts,
        ends,
        query_start_loc,
        batch.wants_prompt_logprobs[rows],
        batch.num_prompt_tokens[rows],
        batch.host_token_ids,
    )
    logits_indices = samples.logits_indices
    if verify is not None:
        logits_indices = np.concatenate([logits_indices, verify.logits_indices])
    if prompt_rows:
        logits_indices = np.concatenate([logits_indices, np.asarray(prompt_rows, dtype=np.int64)])
    seq_index, seq_query_start_loc, seq_lens = expand_decodes(
        query_start_loc, compute_seq_lens(ends, num_dropped), num_decode_reqs
    )
    seq_rows = rows[seq_index]
    num_decodes = int(query_start_loc[num_decode_reqs])  # each decode token is a sequence
    groups = decode_query_lens(query_start_loc, num_decode_reqs) if expand_verify else None
    # A verification is a decode and its drafts: the kernels' rows hold k + 1 tokens, no more.
    assert groups is None or groups.max(initial=0) <= expand_verify, "a group past num_speculative_tokens + 1"
    pad_to = graph_padding(graph_runner, len(seq_rows), num_decodes)
    if pad_to:
        # The graph's padding rows are decodes of one token each.
        seq_query_start_loc = np.arange(pad_to + 1)
    return StepPlan(
        rows=rows,
        req_query_start_loc=query_start_loc,
        seq_rows=seq_rows,
        num_decodes=num_decodes,
        max_query_len=int(query_lens[num_decode_reqs:].max(initial=1)),
        input_ids=input_ids,
        device_input_index=device_input_index,
        device_input_rows=device_input_rows,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=seq_query_start_loc.astype(np.int32),
        seq_lens=seq_lens,
        logits_indices=logits_indices,
        samples=samples,
        sample_req_ids=[batch.req_ids[row] for row in samples.sample_rows.tolist()],
        prompt_logprob_requests=prompt_requests,
        pad_to=pad_to,
        state_slots=batch.state_slots[seq_rows],
        verify=verify,
        decode_query_lens=groups,
        max_decode_query_len=max(expand_verify, 1),
    )


def stage_block_tables(
    batch: InputBatch, buffers: InputBuffers, rows: np.ndarray, width: int, pad_to: int
) -> torch.Tensor:
    """[num_seqs (or pad_to), width (the buffer's on a GPU)] int32: the sequences' block table
    rows (``rows``: their batch rows, a request's repeated per expanded token). On a GPU they are
    gathered on the device from the persistent table into the graph-visible buffer, and padding
    rows read block 0."""
    if buffers.on_host:
        return torch.from_numpy(batch.block_table[rows, :width])
    out = buffers.device_view("block_tables", max(len(rows), pad_to))
    index = buffers.put("req_rows", rows)
    torch.index_select(batch.block_table_device, 0, index, out=out[: len(rows)])
    out[len(rows) :].zero_()
    return out


def stage_model_input(
    plan: StepPlan, batch: InputBatch, buffers: InputBuffers, tokens_per_block: int, has_state: bool = False
) -> ModelInput:
    """The plan in device tensors: each array copied into its buffer (padded to the graph's batch
    size with tokens that write nothing, slot -1, and attend to one, seq_len 1; with
    ``has_state``, a hybrid model's, their state rows, the scratch row -1), decode inputs
    the device holds copied from ``last_token_ids``, block table rows gathered on the device."""
    put, pad_to = buffers.put, plan.pad_to
    input_ids = put("input_ids", plan.input_ids, pad_to)
    if len(plan.device_input_rows):
        index = put("device_input_index", plan.device_input_index)
        src_rows = put("device_input_rows", plan.device_input_rows)
        input_ids.index_copy_(0, index, batch.last_token_ids.index_select(0, src_rows))
    seq_lens = plan.seq_lens
    max_seq_len = int(seq_lens.max())
    num_decodes = plan.num_decodes
    attn_metadata = AttentionMetadata(
        num_decodes=num_decodes,
        num_prefills=len(plan.seq_rows) - num_decodes,
        slot_mapping=put("slot_mapping", plan.slot_mapping, pad_to, -1),
        query_start_loc=put("query_start_loc", plan.query_start_loc),
        seq_lens=put("seq_lens", seq_lens, pad_to, 1),
        block_tables=stage_block_tables(
            batch, buffers, plan.seq_rows, block_table_width(max_seq_len, tokens_per_block), pad_to
        ),
        max_query_len=plan.max_query_len,
        max_seq_len=max_seq_len,
        query_start_loc_cpu=torch.from_numpy(plan.query_start_loc),
        seq_lens_cpu=torch.from_numpy(seq_lens),
        min_decode_seq_len=int(seq_lens[:num_decodes].min()) if num_decodes else 0,
        state_slots=put("state_slots", plan.state_slots, pad_to, -1) if has_state else None,
        # A graph's padding rows are lone decodes.
        decode_query_lens=None
        if plan.decode_query_lens is None
        else put("decode_query_lens", plan.decode_query_lens, pad_to, 1),
        max_decode_query_len=plan.max_decode_query_len,
    )
    samples = plan.samples
    return ModelInput(
        input_ids=input_ids,
        positions=put("positions", plan.positions, pad_to),
        attn_metadata=attn_metadata,
        logits_indices=to_device(plan.logits_indices, buffers.device),
        sample_req_ids=plan.sample_req_ids,
        sample_rows=samples.sample_rows,
        sampling_req_rows=samples.sampling_req_rows,
        first_sample_index=samples.first_sample_index,
        prompt_logprob_requests=plan.prompt_logprob_requests,
        graph_num_seqs=len(plan.seq_rows) if pad_to else None,
        verify=plan.verify,
        req_rows=plan.rows,
        req_query_start_loc=plan.req_query_start_loc,
    )
