"""The worker's persistent batch: one row per running request, updated by each step's diffs.

A request's row holds what the worker needs to build its inputs and sample it, so that a decode
step writes only what changed:

- ``num_computed_tokens`` and the tokens the host sent (prompt, and outputs of a resumed request);
  tokens the worker sampled itself never go to the host and back: the next input of a decoding
  request is read from ``last_token_ids`` on the device;
- the block table, on the host and on the device, changed only where the scheduler's diff says,
  and behind a sliding window the tokens whose blocks it dropped;
- the sampling parameters as arrays, gathered per step into ``SamplingMetadata`` tensors;
- penalty counts on the device ([rows, vocab], allocated on first use), grown by one scatter of
  the sampled tokens per step.

Rows are reused through a free list; a step reads its requests' rows by index, so the order of
rows never matters and nothing is compacted.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from pagedllm.sample.constraints import has_logits_processors
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.step_io import NewRequestData, SchedulerOutput
from pagedllm.worker.input_buffers import to_device

# Columns of the per-row float parameters, gathered for a step in one array.
_TEMPERATURE, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION = range(6)


class InputBatch:
    """Args:
    max_num_rows: most requests held at once.
    max_blocks_per_req: block table width (blocks of a max_model_len request).
    vocab_size: for penalty counts and top-k.
    """

    def __init__(
        self, max_num_rows: int, max_blocks_per_req: int, vocab_size: int, device: torch.device
    ) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.max_num_rows = max_num_rows
        self.row_of: dict[int, int] = {}
        self._free_rows = list(reversed(range(max_num_rows)))
        self.req_ids: list[int | None] = [None] * max_num_rows
        self.num_computed_tokens = np.zeros(max_num_rows, dtype=np.int64)
        self.num_output_tokens = np.zeros(max_num_rows, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_rows, dtype=np.int64)
        # Tokens the host sent (prompt + the outputs it knew), and all tokens the row has: those
        # plus the samples the worker drew since. A step that reaches num_tokens samples.
        self.num_host_tokens = np.zeros(max_num_rows, dtype=np.int64)
        self.num_tokens = np.zeros(max_num_rows, dtype=np.int64)
        # Token ids the host sent per row (prompt, then the outputs it knew when it sent them).
        self.host_token_ids: list[np.ndarray | None] = [None] * max_num_rows
        # Rows with logits processors: the worker's own samples since, once they reach the host
        # (a grammar or bad words read the output history; the host does not resend it).
        self.sampled_output_ids: list[list[int]] = [[] for _ in range(max_num_rows)]
        self.block_table = np.zeros((max_num_rows, max_blocks_per_req), dtype=np.int32)
        # Tokens whose blocks left the row's table behind a sliding window: the attention kernels
        # see position p at cache position p - this.
        self.num_dropped_tokens = np.zeros(max_num_rows, dtype=np.int64)
        # Recurrent-state row of each request (hybrid models; -1: none).
        self.state_slots = np.full(max_num_rows, -1, dtype=np.int64)
        self.block_table_device = (
            torch.from_numpy(self.block_table)
            if device.type == "cpu"
            else torch.zeros(self.block_table.shape, dtype=torch.int32, device=device)
        )
        self._dirty_rows: set[int] = set()
        # [rows] int64 on the device: each row's newest sampled token, the next decode input.
        self.last_token_ids = torch.zeros(max_num_rows, dtype=torch.int64, device=device)
        self.params: list[SamplingParams | None] = [None] * max_num_rows
        self.float_params = np.zeros((6, max_num_rows), dtype=np.float32)
        self.top_k = np.zeros(max_num_rows, dtype=np.int64)
        self.greedy = np.ones(max_num_rows, dtype=bool)
        self.num_samples = np.ones(max_num_rows, dtype=np.int64)
        self.num_top_tokens = np.zeros(max_num_rows, dtype=np.int64)
        self.wants_logprobs = np.zeros(max_num_rows, dtype=bool)
        # Rows whose request scores its prompt tokens: a step looks only at these for prompt rows.
        self.wants_prompt_logprobs = np.zeros(max_num_rows, dtype=bool)
        self.min_tokens = np.zeros(max_num_rows, dtype=np.int64)
        self.min_tokens_stop_ids: list[list[int]] = [[] for _ in range(max_num_rows)]
        self.has_penalty = np.zeros(max_num_rows, dtype=bool)
        # Rows with per-request logits processors (worker/request_logits.py).
        self.has_processors = np.zeros(max_num_rows, dtype=bool)
        # Each row's LoRA adapter id (0: none).
        self.lora_int_ids = np.zeros(max_num_rows, dtype=np.int64)
        # Seeded requests' generators, by request id: kept across preemption, dropped at the end.
        self.generators: dict[int, torch.Generator] = {}
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None

    # --- rows -----------------------------------------------------------------------------

    def apply_scheduler_output(self, scheduler_output: SchedulerOutput) -> None:
        """Apply a step's diffs: free the rows of finished and preempted requests, add the new
        ones, write the running ones' computed tokens, block table appends and sliding-window
        drops, then copy the changed block table rows to the device (one copy)."""
        for req_id in scheduler_output.finished_req_ids:
            self.remove_request(req_id, finished=True)
        for req_id in scheduler_output.preempted_req_ids:
            self.remove_request(req_id, finished=False)
        for data in scheduler_output.scheduled_new_reqs:
            self.add_request(data)
        cached = scheduler_output.scheduled_cached_reqs
        if cached.req_ids:
            row_of = self.row_of
            rows = np.fromiter((row_of[r] for r in cached.req_ids), dtype=np.int64, count=len(cached.req_ids))
            self.num_computed_tokens[rows] = cached.num_computed_tokens
            for row, diff in zip(rows.tolist(), cached.block_table_diffs):
                if diff is not None:
                    self.set_block_ids(row, diff[0], diff[1])
        for req_id, num_dropped in scheduler_output.num_dropped_tokens.items():
            self.num_dropped_tokens[self.row_of[req_id]] = num_dropped
        self.sync_block_table()

    def add_request(self, data: NewRequestData) -> int:
        if data.req_id in self.row_of:
            self.remove_request(data.req_id, finished=False)
        if not self._free_rows:
            raise RuntimeError(f"the persistent batch is full ({self.max_num_rows} rows)")
        row = self._free_rows.pop()
        self.row_of[data.req_id] = row
        self.req_ids[row] = data.req_id
        self.num_computed_tokens[row] = data.num_computed_tokens
        self.num_prompt_tokens[row] = len(data.prompt_token_ids)
        self.num_output_tokens[row] = len(data.output_token_ids)
        tokens = np.asarray(data.prompt_token_ids + data.output_token_ids, dtype=np.int64)
        self.host_token_ids[row] = tokens
        self.sampled_output_ids[row] = []
        self.num_host_tokens[row] = self.num_tokens[row] = len(tokens)
        self.num_dropped_tokens[row] = 0
        self.state_slots[row] = data.state_slot
        self.set_block_ids(row, 0, data.block_ids)
        self.lora_int_ids[row] = data.lora_request.lora_int_id if data.lora_request is not None else 0
        self._add_sampling(row, data)
        return row

    def _add_sampling(self, row: int, data: NewRequestData) -> None:
        p = data.sampling_params
        greedy = p.is_greedy or p.use_beam_search
        self.params[row] = p
        self.greedy[row] = greedy
        self.float_params[:, row] = (
            1.0 if greedy else p.temperature,
            p.top_p,
            p.min_p,
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
        )
        self.top_k[row] = self.vocab_size if p.top_k in (-1, 0) else min(p.top_k, self.vocab_size)
        self.num_samples[row] = data.num_samples
        self.num_top_tokens[row] = data.num_top_tokens
        self.wants_logprobs[row] = p.logprobs is not None or data.num_top_tokens > 0
        self.wants_prompt_logprobs[row] = p.prompt_logprobs is not None
        self.min_tokens[row] = p.min_tokens
        self.min_tokens_stop_ids[row] = data.min_tokens_stop_ids
        if data.seed is not None and data.req_id not in self.generators:
            self.generators[data.req_id] = torch.Generator(device=self.device).manual_seed(data.seed)
        self.has_processors[row] = has_logits_processors(p)
        self.has_penalty[row] = (
            p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
        )
        if self.has_penalty[row]:
            self._init_penalty_counts(row, data)
        if data.output_token_ids:
            self.last_token_ids[row] = data.output_token_ids[-1]

    def _init_penalty_counts(self, row: int, data: NewRequestData) -> None:
        shape = (self.max_num_rows, self.vocab_size)
        if self.output_counts is None:
            self.output_counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        assert self.prompt_mask is not None
        outputs = to_device(data.output_token_ids, self.device, torch.int64)
        prompt = to_device(data.prompt_token_ids, self.device, torch.int64)
        self.output_counts[row] = torch.bincount(outputs, minlength=self.vocab_size)
        self.prompt_mask[row] = torch.bincount(prompt, minlength=self.vocab_size) > 0

    def remove_request(self, req_id: int, finished: bool) -> None:
        """Free the request's row; a finished request also lets go of its seeded generator (a
        preempted one keeps it: it comes back)."""
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.req_ids[row] = None
            self.host_token_ids[row] = None
            self.params[row] = None
            self._free_rows.append(row)
        if finished:
            self.generators.pop(req_id, None)

    def set_block_ids(self, row: int, start: int, block_ids: list[int]) -> None:
        end = start + len(block_ids)
        self.block_table[row, start:end] = block_ids
        self._dirty_rows.add(row)

    def sync_block_table(self) -> None:
        """Copy the rows whose tables changed to the device table (one copy for all of them)."""
        if not self._dirty_rows or self.device.type == "cpu":
            self._dirty_rows.clear()
            return
        rows = np.fromiter(self._dirty_rows, dtype=np.int64, count=len(self._dirty_rows))
        self._dirty_rows.clear()
        values = to_device(self.block_table[rows], self.device)
        index = to_device(rows, self.device)
        self.block_table_device.index_copy_(0, index, values)

    # --- sampling -------------------------------------------------------------------------

    def sampling_metadata(
        self, rows: np.ndarray, output_offsets: np.ndarray | None = None
    ) -> SamplingMetadata:
        """Parameters of the sampled rows (a request's row repeated for each of its samples, or
        for each position it verifies). output_offsets: [len(rows)] outputs each row has beyond
        its request's (a verified position: the drafts before it), for min_tokens."""
        device = self.device
        greedy = self.greedy[rows]
        all_greedy = bool(greedy.all())
        metadata = SamplingMetadata(temperature=None, greedy=None, all_greedy=all_greedy)
        if not all_greedy:
            floats = to_device(self.float_params[:, rows], device)
            metadata.temperature = floats[_TEMPERATURE]
            metadata.greedy = to_device(greedy, device)
            top_k = self.top_k[rows]
            if (top_k < self.vocab_size).any():
                metadata.top_k = to_device(top_k, device)
            if (self.float_params[_TOP_P, rows] < 1.0).any():
                metadata.top_p = floats[_TOP_P]
            if (self.float_params[_MIN_P, rows] > 0.0).any():
                metadata.min_p = floats[_MIN_P]
            for i, row in enumerate(rows.tolist()):
                generator = self.generators.get(self.req_ids[row])
                if generator is not None and not greedy[i]:
                    metadata.generators[i] = generator
        if self.has_penalty[rows].any():
            assert self.output_counts is not None and self.prompt_mask is not None
            index = to_device(rows, device)
            floats = to_device(self.float_params[_PRESENCE : _REPETITION + 1, rows], device)
            metadata.presence_penalty, metadata.frequency_penalty, metadata.repetition_penalty = floats
            metadata.output_counts = self.output_counts.index_select(0, index)
            if (self.float_params[_REPETITION, rows] != 1.0).any():
                metadata.prompt_mask = self.prompt_mask.index_select(0, index)
        self._min_tokens_bans(rows, metadata, output_offsets)
        top = self.num_top_tokens[rows]
        metadata.max_num_top_tokens = int(top.max()) if self.wants_logprobs[rows].any() else 0
        if metadata.max_num_top_tokens == 0 and self.wants_logprobs[rows].any():
            metadata.max_num_top_tokens = 1
        beam = (
            np.fromiter(
                (self.params[row].use_beam_search for row in rows.tolist()), dtype=bool, count=len(rows)
            )
            if metadata.max_num_top_tokens
            else None
        )
        if beam is not None and beam.any():
            metadata.beam = to_device(beam, device)
        return metadata

    def _min_tokens_bans(
        self, rows: np.ndarray, metadata: SamplingMetadata, output_offsets: np.ndarray | None
    ) -> None:
        num_outputs = self.num_output_tokens[rows]
        if output_offsets is not None:
            num_outputs = num_outputs + output_offsets
        under = np.flatnonzero(num_outputs < self.min_tokens[rows])
        if not len(under):
            return
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i in under.tolist():
            stop_ids = self.min_tokens_stop_ids[int(rows[i])]
            ban_rows += [i] * len(stop_ids)
            ban_ids += stop_ids
        if ban_rows:
            metadata.banned_rows = to_device(ban_rows, self.device, torch.int64)
            metadata.banned_token_ids = to_device(ban_ids, self.device, torch.int64)

    def output_token_ids(self, row: int, start: int = 0) -> list[int]:
        """The row's generated tokens on the host from index ``start``: those the host sent, then
        the samples appended since (``append_sampled``; rows with logits processors only)."""
        tokens = self.host_token_ids[row]
        assert tokens is not None
        num_sent = int(self.num_host_tokens[row] - self.num_prompt_tokens[row])
        sampled = self.sampled_output_ids[row]
        if start >= num_sent:
            return sampled[start - num_sent :]
        sent = tokens[int(self.num_prompt_tokens[row]) + start : int(self.num_host_tokens[row])]
        return sent.tolist() + sampled

    def append_sampled(self, samples: Iterable[tuple[int, int, int]]) -> None:
        """Record each (req_id, output index, token id): the request's ``output_index``-th
        generated token, once it reaches the host, unless the host already sent it (a request
        resent in full knows its outputs) or the request has left the batch."""
        row_of, sampled_output_ids = self.row_of, self.sampled_output_ids
        num_sent = (self.num_host_tokens - self.num_prompt_tokens).tolist()  # one numpy pass
        for req_id, output_index, token_id in samples:
            row = row_of.get(req_id)
            if row is not None:
                sampled = sampled_output_ids[row]
                if num_sent[row] + len(sampled) == output_index:
                    sampled.append(token_id)

    def record_samples(self, rows: np.ndarray, sample_index: torch.Tensor, token_ids: torch.Tensor) -> None:
        """After sampling: each sampled request's newest token (its first sample) becomes its next
        decode input, and penalty counts grow by it, without leaving the device.

        rows: [num_reqs] the requests' rows; sample_index: [num_reqs] (device) where each one's
        first sample is in ``token_ids``.
        """
        self.num_output_tokens[rows] += 1
        self.num_tokens[rows] += 1
        # A best_of request draws its first tokens together; the scheduler forks it, and each
        # sequence draws one token per step from then on.
        self.num_samples[rows] = 1
        index = to_device(rows, self.device)
        tokens = token_ids.index_select(0, sample_index)
        self.last_token_ids.index_copy_(0, index, tokens)
        if self.output_counts is not None and self.has_penalty[rows].any():
            ones = torch.ones_like(tokens, dtype=self.output_counts.dtype)
            self.output_counts.index_put_((index, tokens), ones, accumulate=True)

    def record_verified_on_device(
        self, rows: np.ndarray, output_token_ids: torch.Tensor, num_accepted: torch.Tensor
    ) -> None:
        """After a verification of drafts (speculative decoding), its device side: each request's
        last emitted token (the one after its accepted drafts) becomes its next decode input, and
        every emitted token counts for penalties, without waiting for the counts. (The output
        history constraints read is not extended: requests whose constraints read it, bad words
        and grammars, get no drafts.) ``count_verified`` follows on the host.

        rows: [num_reqs] the requests' rows; output_token_ids: [num_reqs, K + 1] (device) the
        accepted drafts, then the token after them, then -1; num_accepted: [num_reqs] (device).
        """
        index = to_device(rows, self.device)
        self.last_token_ids.index_copy_(0, index, output_token_ids.gather(1, num_accepted[:, None])[:, 0])
        if self.output_counts is not None and self.has_penalty[rows].any():
            emitted = (output_token_ids >= 0).to(self.output_counts.dtype)  # -1 past the emitted
            index = index[:, None].expand_as(output_token_ids)
            self.output_counts.index_put_((index, output_token_ids.clamp(min=0)), emitted, accumulate=True)

    def count_verified(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """A verification's host side: each request's row grows by its ``counts`` emitted tokens."""
        self.num_output_tokens[rows] += counts
        self.num_tokens[rows] += counts
