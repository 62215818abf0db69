"""Builds each step's flattened batch and runs the model and the sampler on it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.attention.backends.abstract import AttentionBackend, KVCache
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import EngineConfig
from pagedllm.layers.sampler import Sampler, SamplingGroup
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.cuda_graph import CudaGraphRunner, default_capture_sizes
from pagedllm.worker.execute_request import ModelRunnerOutput, ScheduledSequence, SequenceGroupMetadata
from pagedllm.worker.input_buffers import InputBuffers
from pagedllm.worker.request_logits import RequestLogitsProcessors
from pagedllm.worker.sampling_rows import (
    PromptLogprobRequest,
    prompt_logprob_rows,
    sampling_rows,
    score_prompts,
)


@dataclass
class ModelInput:
    """One forward pass's inputs: the flattened batch and which hidden rows to score."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    # [num_sample_rows + num_prompt_rows] int64: the hidden-state row of each sample to draw (a row
    # repeats when a request draws several first tokens), then of each prompt logprob to score.
    logits_indices: torch.Tensor
    sampling_groups: list[SamplingGroup]
    prompt_logprob_requests: list[PromptLogprobRequest]
    # Set when the step replays a captured CUDA graph (all decodes): the real batch size.
    graph_num_seqs: int | None = None

    @property
    def num_sample_rows(self) -> int:
        return sum(len(group.seq_ids) for group in self.sampling_groups)


def compute_slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """Cache slot of each position in [start, end): block_table[pos // bs] * bs + pos % bs."""
    positions = np.arange(start, end)
    blocks = np.asarray(block_table, dtype=np.int64)[positions // block_size]
    return blocks * block_size + positions % block_size


class ModelRunner:
    def __init__(self, config: EngineConfig, attn_backend: type[AttentionBackend]) -> None:
        self.config = config
        self.device = config.device_config.device
        self.block_size = config.cache_config.block_size
        self.attn_backend = attn_backend
        self.model: nn.Module | None = None
        self.sampler = Sampler()
        self.logits_processors = RequestLogitsProcessors()
        scheduler_config = config.scheduler_config
        self.max_model_len = config.model_config.max_model_len
        self.use_cuda_graphs = (
            self.device.type == "cuda" and not config.enforce_eager and attn_backend.supports_cuda_graphs
        )
        self.capture_sizes = (
            default_capture_sizes(scheduler_config.max_num_seqs) if self.use_cuda_graphs else []
        )
        self.buffers = InputBuffers(
            max_num_tokens=max([scheduler_config.max_num_batched_tokens, *self.capture_sizes]),
            max_num_seqs=scheduler_config.max_num_seqs,
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
            device=self.device,
        )
        self.graph_runner: CudaGraphRunner | None = None

    def load_model(self) -> None:
        from pagedllm.model_loader import get_model

        self.model = get_model(
            self.config.model_config, self.config.load_config.load_format, self.device, self.attn_backend
        )

    # --- setup: memory profile and CUDA graphs ----------------------------------------------

    @torch.inference_mode()
    def profile_run(self, kv_caches: list[KVCache]) -> None:
        """One step at the largest size the scheduler can make: max_num_batched_tokens prompt
        tokens over max_num_seqs sequences, each sampled with top-p (the sampler's biggest
        temporaries). ``kv_caches`` may be a single block: every dummy token maps into it."""
        scheduler_config = self.config.scheduler_config
        num_tokens = scheduler_config.max_num_batched_tokens
        num_seqs = min(scheduler_config.max_num_seqs, num_tokens)
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1)
        groups = []
        for i in range(num_seqs):
            seq_len = min(num_tokens // num_seqs + (i < num_tokens % num_seqs), self.max_model_len)
            seq = ScheduledSequence(
                seq_id=i,
                token_ids=[0] * seq_len,
                num_computed_tokens=0,
                block_table=[0] * -(-seq_len // self.block_size),
                do_sample=True,
                num_output_tokens=0,
            )
            groups.append(SequenceGroupMetadata(str(i), params, [seq], num_samples=1, stop_token_ids=[]))
        self.execute_model(groups, kv_caches, generators={})
        torch.cuda.synchronize(self.device)

    def capture_model(self, kv_caches: list[KVCache]) -> None:
        if not self.use_cuda_graphs:
            return
        assert self.model is not None
        self.graph_runner = CudaGraphRunner(
            self.model, kv_caches, self.buffers, self.capture_sizes, self.max_model_len
        )
        self.graph_runner.capture()

    # --- the step ---------------------------------------------------------------------------

    def prepare_inputs(
        self, seq_groups: list[SequenceGroupMetadata], generators: dict[str, torch.Generator]
    ) -> ModelInput:
        """Flatten the scheduled sequences, decodes first, into one batch (CSR offsets).

        Sequences with one new token go first so that backends can run them through a decode
        kernel; the rest keep the scheduler's order. A step of decodes only, when graphs are
        captured, is padded to the graph's batch size.
        """
        flat = [seq for group in seq_groups for seq in group.seqs]
        flat.sort(key=lambda seq: len(seq.token_ids) != 1)
        num_decodes = sum(1 for seq in flat if len(seq.token_ids) == 1)
        block_size = self.block_size

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        for seq in flat:
            start = seq.num_computed_tokens
            end = start + len(seq.token_ids)
            input_ids += seq.token_ids
            if end - start == 1:
                # The common case, kept free of numpy's per-call overhead.
                positions.append(start)
                slot_mapping.append(seq.block_table[start // block_size] * block_size + start % block_size)
            else:
                positions += range(start, end)
                slot_mapping += compute_slot_mapping(seq.block_table, start, end, block_size).tolist()
            query_start_loc.append(query_start_loc[-1] + end - start)
            seq_lens.append(end)

        last_token_index = {
            seq.seq_id: query_start_loc[i + 1] - 1 for i, seq in enumerate(flat) if seq.do_sample
        }
        logits_indices, sampling_groups = sampling_rows(seq_groups, last_token_index, generators)
        first_token_index = {seq.seq_id: query_start_loc[i] for i, seq in enumerate(flat)}
        prompt_rows, prompt_requests = prompt_logprob_rows(seq_groups, first_token_index)
        logits_indices += prompt_rows

        graph_num_seqs = None
        pad_to = 0
        if self.graph_runner is not None and num_decodes == len(flat) <= self.graph_runner.max_batch_size:
            graph_num_seqs = len(flat)
            pad_to = self.graph_runner.padded_size(len(flat))
            query_start_loc = list(range(pad_to + 1))
        query_start_loc_cpu = torch.tensor(query_start_loc, dtype=torch.int32)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        put = self.buffers.put
        attn_metadata = AttentionMetadata(
            num_decodes=num_decodes,
            num_prefills=len(flat) - num_decodes,
            slot_mapping=put("slot_mapping", np.asarray(slot_mapping, dtype=np.int64), pad_to, -1),
            query_start_loc=put("query_start_loc", query_start_loc_cpu.numpy()),
            seq_lens=put("seq_lens", seq_lens_cpu.numpy(), pad_to, 1),
            block_tables=put("block_tables", _pad_block_tables(flat), pad_to),
            max_query_len=max(len(seq.token_ids) for seq in flat),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        return ModelInput(
            input_ids=put("input_ids", np.asarray(input_ids, dtype=np.int64), pad_to),
            positions=put("positions", np.asarray(positions, dtype=np.int64), pad_to),
            attn_metadata=attn_metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64).to(self.device, non_blocking=True),
            sampling_groups=sampling_groups,
            prompt_logprob_requests=prompt_requests,
            graph_num_seqs=graph_num_seqs,
        )

    @torch.inference_mode()
    def execute_model(
        self,
        seq_groups: list[SequenceGroupMetadata],
        kv_caches: list[KVCache],
        generators: dict[str, torch.Generator],
    ) -> ModelRunnerOutput:
        """One forward pass over every scheduled token, then a sample for each finishing sequence
        and the prompt logprobs asked for."""
        assert self.model is not None, "load_model() first"
        model_input = self.prepare_inputs(seq_groups, generators)
        if model_input.graph_num_seqs is not None:
            assert self.graph_runner is not None
            hidden_states = self.graph_runner.replay(model_input.graph_num_seqs)
        else:
            hidden_states = self.model(
                model_input.input_ids, model_input.positions, kv_caches, model_input.attn_metadata
            )
        if model_input.logits_indices.numel() == 0:
            return ModelRunnerOutput(samples={})
        logits = self.model.compute_logits(hidden_states[model_input.logits_indices])
        num_sample_rows = model_input.num_sample_rows
        if num_sample_rows:
            self.logits_processors(logits[:num_sample_rows], model_input.sampling_groups)
        samples = (
            self.sampler(logits[:num_sample_rows], model_input.sampling_groups) if num_sample_rows else {}
        )
        return ModelRunnerOutput(
            samples=samples,
            prompt_logprobs=score_prompts(logits[num_sample_rows:], model_input.prompt_logprob_requests),
        )


def _pad_block_tables(seqs: list[ScheduledSequence]) -> np.ndarray:
    """[num_seqs, longest] int32, each row a block table padded with 0 (one vectorised fill)."""
    lengths = np.fromiter((len(seq.block_table) for seq in seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter(
        itertools.chain.from_iterable(seq.block_table for seq in seqs),
        dtype=np.int32,
        count=int(lengths.sum()),
    )
    block_tables = np.zeros((len(seqs), int(lengths.max())), dtype=np.int32)
    block_tables[np.arange(block_tables.shape[1]) < lengths[:, None]] = flat
    return block_tables
