"""Turns a SchedulerOutput into one forward pass and one sampling pass over the persistent batch.

A step: apply the scheduler's diffs to the persistent batch (worker/input_batch.py); flatten the
scheduled requests, decodes first, into one batch (CSR offsets) with vectorised index arithmetic;
run the model (a captured CUDA graph for decode-only steps); sample on the device; start the
copy of the samples to the host and return without waiting for it (``StepOutput.get`` waits), so
the engine can schedule the next step while this one runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from pagedllm.attention.backends.abstract import AttentionBackend, KVCache
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import EngineConfig
from pagedllm.sample.sampler import Sampler, SamplerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.step_io import ModelRunnerOutput, NewRequestData, PromptLogprobsOutput, SchedulerOutput
from pagedllm.worker.cpu_compile import CompiledDecode
from pagedllm.worker.cuda_graph import CudaGraphRunner, default_capture_sizes
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.input_buffers import InputBuffers, to_device
from pagedllm.worker.request_logits import RequestLogitsProcessors


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
    # Prompt logprobs: (req_id, first position, target token ids), rows after the sample rows.
    prompt_logprob_requests: list[tuple[int, int, list[int]]] = field(default_factory=list)
    # Set when the step replays a captured CUDA graph (all decodes): the real batch size.
    graph_num_seqs: int | None = None


class StepOutput:
    """A step's samples, possibly still on their way to the host. ``get()`` waits for them."""

    def __init__(
        self,
        model_input: ModelInput | None,
        sampled: SamplerOutput | None,
        top_rows: list[int],
        prompt_logprobs: list[tuple[int, int, list[int], torch.Tensor, tuple]],
        device: torch.device,
        num_top_tokens: list[int] | None = None,
    ) -> None:
        self._model_input = model_input
        self._top_rows = top_rows
        # Per top row, how many top tokens its request asked for.
        self._num_top_tokens = num_top_tokens or []
        self._prompt_logprobs = prompt_logprobs
        self._host: list[torch.Tensor | None] = []
        self._event = None
        if sampled is None:
            return
        tensors = [sampled.token_ids, sampled.logprobs]
        if top_rows:
            tensors += [sampled.ranks, sampled.top_token_ids, sampled.top_logprobs]
        if device.type == "cuda":
            # One D2H copy per tensor into pinned memory, then an event: the host waits only when
            # it reads the samples, one step later with asynchronous scheduling. The samples'
            # buffer holds -1 until its copy lands, which the grammar thread waits on.
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            self._host[0].numpy().fill(-1)
            for host, tensor in zip(self._host, tensors):
                host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensors

    def samples_on_host(self) -> torch.Tensor:
        """The sampled ids' host buffer [num sample rows] int64, without waiting: on CUDA it holds
        -1 until the copy lands."""
        return self._host[0]

    def sampled_token_ids(self) -> list[int]:
        """The sampled ids of the step's sample rows, once they are on the host."""
        if self._event is not None:
            self._event.synchronize()
        return self._host[0].tolist() if self._host else []

    def get(self) -> ModelRunnerOutput:
        output = ModelRunnerOutput()
        if self._event is not None:
            self._event.synchronize()
        if self._host:
            assert self._model_input is not None
            output.req_ids = self._model_input.sample_req_ids
            output.sampled_token_ids = self._host[0].tolist()
            output.logprobs = self._host[1].tolist()
        if self._top_rows:
            ranks, top_ids, top_logprobs = (t.tolist() for t in self._host[2:5])
            for i, k in zip(self._top_rows, self._num_top_tokens):
                output.top_tokens[i] = (ranks[i], top_ids[i][:k], top_logprobs[i][:k])
        for req_id, start, targets, chosen, (ranks, top_values, top_ids, k) in self._prompt_logprobs:
            output.prompt_logprobs[req_id] = PromptLogprobsOutput(
                start,
                targets,
                chosen.tolist(),
                ranks.tolist(),
                [ids[:k] for ids in top_ids.tolist()],
                [values[:k] for values in top_values.tolist()],
            )
        return output


def compute_slot_mapping(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of each position: block_table[pos // block_size] * block_size + pos % block_size.
    block_table: [num_tokens, width] (each token's request's row) or [width] (one request)."""
    blocks = (
        np.take_along_axis(block_table, (positions // block_size)[:, None], axis=-1)[:, 0]
        if (block_table.ndim == 2)
        else block_table[positions // block_size]
    )
    return blocks.astype(np.int64) * block_size + positions % block_size


class ModelRunner:
    def __init__(self, config: EngineConfig, attn_backend: type[AttentionBackend]) -> None:
        self.config = config
        self.device = config.device_config.device
        self.block_size = config.cache_config.block_size
        self.attn_backend = attn_backend
        self.model: nn.Module | None = None
        self.sampler = Sampler(self.device)
        scheduler_config = config.scheduler_config
        self.max_model_len = config.model_config.max_model_len
        self.use_cuda_graphs = (
            self.device.type == "cuda" and not config.enforce_eager and attn_backend.supports_cuda_graphs
        )
        self.capture_sizes = (
            default_capture_sizes(scheduler_config.max_num_seqs) if self.use_cuda_graphs else []
        )
        max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.buffers = InputBuffers(
            max_num_tokens=max([scheduler_config.max_num_batched_tokens, *self.capture_sizes]),
            max_num_seqs=scheduler_config.max_num_seqs,
            max_blocks_per_seq=max_blocks_per_req,
            device=self.device,
        )
        # Rows for every request the scheduler can keep running, and the forks a best_of request
        # adds after its first sample (bounded by max_num_seqs too; the slack is for requests
        # that finished in a step still in flight).
        self.input_batch = InputBatch(
            2 * scheduler_config.max_num_seqs, max_blocks_per_req, config.model_config.vocab_size, self.device
        )
        self.logits_processors = RequestLogitsProcessors(
            self.input_batch, config.model_config, fill_ahead=self.device.type == "cuda"
        )
        self.graph_runner: CudaGraphRunner | None = None
        self.compiled_decode: CompiledDecode | None = None

    def load_model(self) -> None:
        from pagedllm.model_loader import get_model

        self.model = get_model(
            self.config.model_config, self.config.load_config.load_format, self.device, self.attn_backend
        )

    # --- setup: memory profile and CUDA graphs ----------------------------------------------

    @torch.inference_mode()
    def profile_run(self, kv_caches: list[KVCache]) -> None:
        """One step at the largest size the scheduler can make: max_num_batched_tokens prompt
        tokens over max_num_seqs requests, each sampled with top-p (the sampler's biggest
        temporaries). ``kv_caches`` may be a single block: every dummy token maps into it."""
        scheduler_config = self.config.scheduler_config
        num_tokens = scheduler_config.max_num_batched_tokens
        num_reqs = min(scheduler_config.max_num_seqs, num_tokens)
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1)
        out = SchedulerOutput()
        for i in range(num_reqs):
            prompt_len = min(num_tokens // num_reqs + (i < num_tokens % num_reqs), self.max_model_len)
            num_blocks = -(-prompt_len // self.block_size)
            out.scheduled_new_reqs.append(
                NewRequestData(i, None, [0] * prompt_len, [], params, [0] * num_blocks, 0, 1, [], 0)
            )
            out.num_scheduled_tokens[i] = prompt_len
            out.total_num_scheduled_tokens += prompt_len
        self.execute_model(out, kv_caches).get()
        for i in range(num_reqs):
            self.input_batch.remove_request(i, finished=True)
        self.sampler.warm_up(self.config.model_config.vocab_size, self.device)
        torch.cuda.synchronize(self.device)

    def capture_model(self, kv_caches: list[KVCache]) -> None:
        assert self.model is not None
        if self.config.compile_cpu_decode and CompiledDecode.supports(self.model):
            self.compiled_decode = CompiledDecode(self.model)
            self.compiled_decode.compile(kv_caches)
        if not self.use_cuda_graphs:
            return
        self.graph_runner = CudaGraphRunner(
            self.model, kv_caches, self.buffers, self.capture_sizes, self.max_model_len
        )
        self.graph_runner.capture()

    # --- the step ---------------------------------------------------------------------------

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the step's diffs to the persistent batch."""
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            batch.remove_request(req_id, finished=True)
        for req_id in scheduler_output.preempted_req_ids:
            batch.remove_request(req_id, finished=False)
        self.logits_processors.drop(scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids)
        for data in scheduler_output.scheduled_new_reqs:
            batch.add_request(data)
        cached = scheduler_output.scheduled_cached_reqs
        if cached.req_ids:
            row_of = batch.row_of
            rows = np.fromiter((row_of[r] for r in cached.req_ids), dtype=np.int64, count=len(cached.req_ids))
            batch.num_computed_tokens[rows] = cached.num_computed_tokens
            for row, diff in zip(rows.tolist(), cached.block_table_diffs):
                if diff is not None:
                    batch.set_block_ids(row, diff[0], diff[1])
        for req_id, num_dropped in scheduler_output.num_dropped_tokens.items():
            batch.num_dropped_tokens[batch.row_of[req_id]] = num_dropped
        batch.sync_block_table()

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInput:
        """Flatten the scheduled requests, decodes first, into one batch (CSR offsets).

        Requests with one new token go first so that backends can run them through a decode
        kernel. A step of decodes only, when graphs are captured, is padded to the graph's batch
        size. Every index (positions, slots, sample rows) is computed with array operations over
        the requests; only prefill chunks and prompt logprobs loop in Python.
        """
        batch = self.input_batch
        block_size = self.block_size
        num_scheduled = scheduler_output.num_scheduled_tokens
        req_ids = list(num_scheduled)
        counts = np.fromiter(num_scheduled.values(), dtype=np.int64, count=len(req_ids))
        rows = np.fromiter((batch.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        is_decode = counts == 1
        num_decodes = int(is_decode.sum())
        if 0 < num_decodes < len(req_ids):
            order = np.concatenate([np.flatnonzero(is_decode), np.flatnonzero(~is_decode)])
            rows, counts = rows[order], counts[order]
            req_ids = [req_ids[i] for i in order.tolist()]
        num_reqs = len(req_ids)
        starts = batch.num_computed_tokens[rows]
        ends = starts + counts
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        # Attention reads cache positions: behind a sliding window, positions less the dropped
        # blocks' tokens (rotary embeddings take the positions themselves).
        dropped = batch.num_dropped_tokens[rows]
        if num_decodes == num_tokens:
            positions = starts.copy()
            token_rows = rows
            cache_positions = positions - dropped
        else:
            token_rows = np.repeat(rows, counts)
            positions = np.repeat(starts - query_start_loc[:-1], counts) + np.arange(num_tokens)
            cache_positions = positions - np.repeat(dropped, counts)
        slot_mapping = compute_slot_mapping(batch.block_table[token_rows], cache_positions, block_size)

        # Input ids: tokens the host sent, except each decoding request's newest sample, which
        # only the device has (last_token_ids).
        host_lens = batch.num_host_tokens[rows]
        from_host = starts < host_lens
        input_ids = np.zeros(num_tokens, dtype=np.int64)
        for i in np.flatnonzero(from_host).tolist():
            start, end = int(starts[i]), int(ends[i])
            input_ids[query_start_loc[i] : query_start_loc[i + 1]] = batch.host_token_ids[rows[i]][start:end]
        device_index = query_start_loc[:-1][~from_host]
        device_rows = rows[~from_host]

        # Sampling: requests whose step reaches their end; best_of first samples repeat a row.
        samples = ends >= batch.num_tokens[rows]
        sampling_idx = np.flatnonzero(samples)
        sampling_rows = rows[sampling_idx]
        repeats = batch.num_samples[sampling_rows]
        sample_rows = np.repeat(sampling_rows, repeats)
        logits_indices = np.repeat(query_start_loc[1:][sampling_idx] - 1, repeats)
        first_sample_index = np.zeros(len(sampling_idx), dtype=np.int64)
        np.cumsum(repeats[:-1], out=first_sample_index[1:])
        prompt_rows, prompt_requests = self._prompt_logprob_rows(req_ids, rows, starts, ends, query_start_loc)
        if prompt_rows:
            logits_indices = np.concatenate([logits_indices, np.asarray(prompt_rows, dtype=np.int64)])

        graph_num_seqs = None
        pad_to = 0
        if self.graph_runner is not None and num_decodes == num_reqs <= self.graph_runner.max_batch_size:
            graph_num_seqs = num_reqs
            pad_to = self.graph_runner.padded_size(num_reqs)
            query_start_loc = np.arange(pad_to + 1)
        seq_lens = (ends - dropped).astype(np.int32)
        max_seq_len = int(seq_lens.max())
        put = self.buffers.put
        input_ids_t = put("input_ids", input_ids, pad_to)
        if len(device_rows):
            index = put("device_input_index", device_index)
            src_rows = put("device_input_rows", device_rows)
            input_ids_t.index_copy_(0, index, batch.last_token_ids.index_select(0, src_rows))
        attn_metadata = AttentionMetadata(
            num_decodes=num_decodes,
            num_prefills=num_reqs - num_decodes,
            slot_mapping=put("slot_mapping", slot_mapping, pad_to, -1),
            query_start_loc=put("query_start_loc", query_start_loc.astype(np.int32)),
            seq_lens=put("seq_lens", seq_lens, pad_to, 1),
            block_tables=self._block_tables(rows, max_seq_len, pad_to),
            max_query_len=int(counts.max()),
            max_seq_len=max_seq_len,
            query_start_loc_cpu=torch.from_numpy(query_start_loc.astype(np.int32)),
            seq_lens_cpu=torch.from_numpy(seq_lens),
            min_decode_seq_len=int(seq_lens[:num_decodes].min()) if num_decodes else 0,
        )
        return ModelInput(
            input_ids=input_ids_t,
            positions=put("positions", positions, pad_to),
            attn_metadata=attn_metadata,
            logits_indices=to_device(logits_indices, self.device),
            sample_req_ids=[batch.req_ids[row] for row in sample_rows.tolist()],
            sample_rows=sample_rows,
            sampling_req_rows=sampling_rows,
            first_sample_index=first_sample_index,
            prompt_logprob_requests=prompt_requests,
            graph_num_seqs=graph_num_seqs,
        )

    def _block_tables(self, rows: np.ndarray, max_seq_len: int, pad_to: int) -> torch.Tensor:
        """[num_reqs (or pad_to), width] int32: the requests' block table rows. On a GPU they are
        gathered on the device from the persistent table into the graph-visible buffer."""
        batch = self.input_batch
        if self.device.type == "cpu":
            width = -(-max_seq_len // self.block_size)
            return torch.from_numpy(batch.block_table[rows, :width])
        out = self.buffers.device_view("block_tables", max(len(rows), pad_to))
        index = self.buffers.put("req_rows", rows)
        torch.index_select(batch.block_table_device, 0, index, out=out[: len(rows)])
        out[len(rows) :].zero_()
        return out

    def _prompt_logprob_rows(
        self,
        req_ids: list[int],
        rows: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        query_start_loc: np.ndarray,
    ) -> tuple[list[int], list[tuple[int, int, list[int]]]]:
        """Hidden rows scoring prompt tokens (position p scores prompt token p + 1), for requests
        that asked for prompt logprobs."""
        batch = self.input_batch
        hidden_rows: list[int] = []
        requests: list[tuple[int, int, list[int]]] = []
        for i, row in enumerate(rows.tolist()):
            params = batch.params[row]
            if params is None or params.prompt_logprobs is None:
                continue
            start = int(starts[i])
            end = min(int(ends[i]), int(batch.num_prompt_tokens[row]) - 1)
            if end <= start:
                continue
            hidden_rows += range(int(query_start_loc[i]), int(query_start_loc[i]) + end - start)
            targets = batch.host_token_ids[row][start + 1 : end + 1].tolist()
            requests.append((req_ids[i], start, targets))
        return hidden_rows, requests

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput, kv_caches: list[KVCache]) -> StepOutput:
        """One forward pass over every scheduled token, then a sample for each request that
        reaches its end and the prompt logprobs asked for. Returns without waiting for the
        samples to reach the host."""
        assert self.model is not None, "load_model() first"
        self.update_states(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            return StepOutput(None, None, [], [], self.device)
        model_input = self.prepare_inputs(scheduler_output)
        if model_input.graph_num_seqs is not None:
            assert self.graph_runner is not None
            hidden_states = self.graph_runner.replay(model_input.graph_num_seqs)
        elif self.compiled_decode is not None and CompiledDecode.applies(
            model_input.attn_metadata, scheduler_output.total_num_scheduled_tokens
        ):
            hidden_states = self.compiled_decode(
                model_input.input_ids, model_input.positions, kv_caches, model_input.attn_metadata
            )
        else:
            hidden_states = self.model(
                model_input.input_ids, model_input.positions, kv_caches, model_input.attn_metadata
            )
        if model_input.logits_indices.numel() == 0:
            return StepOutput(model_input, None, [], [], self.device)
        logits = self.model.compute_logits(hidden_states[model_input.logits_indices])
        num_sample_rows = len(model_input.sample_rows)
        batch = self.input_batch
        sampled = None
        top_rows: list[int] = []
        if num_sample_rows:
            # Allowed tokens, logit bias and bad words edit the logits; a grammar gives a bitmask,
            # which the sampler applies.
            token_bitmask = self.logits_processors.before_sampling(logits[:num_sample_rows], model_input)
            metadata = batch.sampling_metadata(model_input.sample_rows)
            sampled = self.sampler(logits[:num_sample_rows], metadata, token_bitmask)
            first = to_device(model_input.first_sample_index, self.device)
            batch.record_samples(model_input.sampling_req_rows, first, sampled.token_ids)
            if metadata.max_num_top_tokens:
                top_rows = np.flatnonzero(batch.wants_logprobs[model_input.sample_rows]).tolist()
        prompt_logprobs = self._score_prompts(logits[num_sample_rows:], model_input)
        num_top_tokens = batch.num_top_tokens[model_input.sample_rows[top_rows]].tolist() if top_rows else []
        step = StepOutput(model_input, sampled, top_rows, prompt_logprobs, self.device, num_top_tokens)
        if num_sample_rows:
            self.logits_processors.after_launch(step)
        return step

    def _score_prompts(
        self, logits: torch.Tensor, model_input: ModelInput
    ) -> list[tuple[int, int, list[int], torch.Tensor, tuple]]:
        """logits: [prompt rows, vocab], the requests' rows in order."""
        requests = model_input.prompt_logprob_requests
        if not requests:
            return []
        batch = self.input_batch
        targets = to_device([t for _, _, ts in requests for t in ts], logits.device, torch.int64)
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(-1, targets[:, None]).squeeze(-1)
        ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
        scored = []
        row = 0
        for req_id, start, ts in requests:
            k = batch.params[batch.row_of[req_id]].prompt_logprobs or 0
            rows = slice(row, row + len(ts))
            top_values, top_ids = logprobs[rows].topk(max(k, 1), dim=-1)
            scored.append((req_id, start, ts, chosen[rows], (ranks[rows], top_values, top_ids, k)))
            row += len(ts)
        return scored
