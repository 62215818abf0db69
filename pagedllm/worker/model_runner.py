"""Builds each step's flattened batch and runs the model and the sampler on it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.attention.backends.abstract import AttentionBackend, KVCache
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import EngineConfig
from pagedllm.layers.sampler import Sampler, SamplingGroup, SequenceSample, top_logprobs
from pagedllm.worker.execute_request import ModelRunnerOutput, ScheduledSequence, SequenceGroupMetadata


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

    @property
    def num_sample_rows(self) -> int:
        return sum(len(group.seq_ids) for group in self.sampling_groups)


@dataclass
class PromptLogprobRequest:
    """One request's prompt positions scored this step (rows follow the sampling rows)."""

    request_id: str
    seq_id: int
    target_token_ids: list[int]
    num_top_tokens: int


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

    def load_model(self) -> None:
        from pagedllm.model_loader import get_model

        self.model = get_model(
            self.config.model_config, self.config.load_config.load_format, self.device, self.attn_backend
        )

    def prepare_inputs(
        self, seq_groups: list[SequenceGroupMetadata], generators: dict[str, torch.Generator]
    ) -> ModelInput:
        """Flatten the scheduled sequences, decodes first, into one batch (CSR offsets).

        Sequences with one new token go first so that backends can run them through a decode
        kernel; the rest keep the scheduler's order.
        """
        flat = [(g, seq) for g, group in enumerate(seq_groups) for seq in group.seqs]
        flat.sort(key=lambda item: len(item[1].token_ids) != 1)
        num_decodes = sum(1 for _, seq in flat if len(seq.token_ids) == 1)

        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slot_mapping: list[np.ndarray] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        # Where each sampling sequence's last token lands in the batch.
        last_token_index: dict[int, int] = {}
        for _, seq in flat:
            start = seq.num_computed_tokens
            end = start + len(seq.token_ids)
            input_ids.extend(seq.token_ids)
            positions.append(np.arange(start, end))
            slot_mapping.append(compute_slot_mapping(seq.block_table, start, end, self.block_size))
            query_start_loc.append(query_start_loc[-1] + len(seq.token_ids))
            seq_lens.append(end)
            if seq.do_sample:
                last_token_index[seq.seq_id] = query_start_loc[-1] - 1

        block_tables = self._pad_block_tables([seq for _, seq in flat])
        logits_indices, sampling_groups = self._sampling_rows(seq_groups, last_token_index, generators)
        first_token_index = {seq.seq_id: query_start_loc[i] for i, (_, seq) in enumerate(flat)}
        prompt_rows, prompt_requests = self._prompt_logprob_rows(seq_groups, first_token_index)
        logits_indices += prompt_rows
        query_start_loc_cpu = torch.tensor(query_start_loc, dtype=torch.int32)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        attn_metadata = AttentionMetadata(
            num_decodes=num_decodes,
            num_prefills=len(flat) - num_decodes,
            slot_mapping=self._to_device(np.concatenate(slot_mapping), torch.int64),
            query_start_loc=query_start_loc_cpu.to(self.device, non_blocking=True),
            seq_lens=seq_lens_cpu.to(self.device, non_blocking=True),
            block_tables=self._to_device(block_tables, torch.int32),
            max_query_len=max(len(seq.token_ids) for _, seq in flat),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        return ModelInput(
            input_ids=self._to_device(np.asarray(input_ids, dtype=np.int64), torch.int64),
            positions=self._to_device(np.concatenate(positions), torch.int64),
            attn_metadata=attn_metadata,
            logits_indices=self._to_device(np.asarray(logits_indices, dtype=np.int64), torch.int64),
            sampling_groups=sampling_groups,
            prompt_logprob_requests=prompt_requests,
        )

    @staticmethod
    def _pad_block_tables(seqs: list[ScheduledSequence]) -> np.ndarray:
        width = max(len(seq.block_table) for seq in seqs)
        block_tables = np.zeros((len(seqs), width), dtype=np.int32)
        for i, seq in enumerate(seqs):
            block_tables[i, : len(seq.block_table)] = seq.block_table
        return block_tables

    @staticmethod
    def _sampling_rows(
        seq_groups: list[SequenceGroupMetadata],
        last_token_index: dict[int, int],
        generators: dict[str, torch.Generator],
    ) -> tuple[list[int], list[SamplingGroup]]:
        logits_indices: list[int] = []
        sampling_groups: list[SamplingGroup] = []
        for group in seq_groups:
            sampling_seqs = [seq for seq in group.seqs if seq.do_sample]
            if not sampling_seqs:
                continue
            seq_ids: list[int] = []
            num_output_tokens: list[int] = []
            output_token_ids: list[list[int]] = []
            for seq in sampling_seqs:
                logits_indices += [last_token_index[seq.seq_id]] * group.num_samples
                seq_ids += [seq.seq_id] * group.num_samples
                num_output_tokens += [seq.num_output_tokens] * group.num_samples
                output_token_ids += [seq.output_token_ids or []] * group.num_samples
            sampling_groups.append(
                SamplingGroup(
                    request_id=group.request_id,
                    params=group.sampling_params,
                    seq_ids=seq_ids,
                    num_output_tokens=num_output_tokens,
                    stop_token_ids=group.stop_token_ids,
                    generator=generators.get(group.request_id),
                    output_token_ids=output_token_ids
                    if sampling_seqs[0].output_token_ids is not None
                    else None,
                    prompt_token_ids=group.prompt_token_ids,
                    num_top_tokens=group.num_top_tokens,
                )
            )
        return logits_indices, sampling_groups

    @staticmethod
    def _prompt_logprob_rows(
        seq_groups: list[SequenceGroupMetadata], first_token_index: dict[int, int]
    ) -> tuple[list[int], list[PromptLogprobRequest]]:
        rows: list[int] = []
        requests: list[PromptLogprobRequest] = []
        for group in seq_groups:
            if not group.prompt_logprob_positions:
                continue
            (seq,) = group.seqs  # prompt logprobs are scored before the request forks
            first = first_token_index[seq.seq_id] - seq.num_computed_tokens
            rows += [first + position for position in group.prompt_logprob_positions]
            requests.append(
                PromptLogprobRequest(
                    group.request_id, seq.seq_id, group.prompt_logprob_targets, group.num_prompt_logprobs
                )
            )
        return rows, requests

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array).to(device=self.device, dtype=dtype, non_blocking=True)

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
        hidden_states = self.model(
            model_input.input_ids, model_input.positions, kv_caches, model_input.attn_metadata
        )
        if model_input.logits_indices.numel() == 0:
            return ModelRunnerOutput(samples={})
        logits = self.model.compute_logits(hidden_states[model_input.logits_indices])
        num_sample_rows = model_input.num_sample_rows
        samples = (
            self.sampler(logits[:num_sample_rows], model_input.sampling_groups) if num_sample_rows else {}
        )
        return ModelRunnerOutput(
            samples=samples,
            prompt_logprobs=_score_prompts(logits[num_sample_rows:], model_input.prompt_logprob_requests),
        )


def _score_prompts(
    logits: torch.Tensor, requests: list[PromptLogprobRequest]
) -> dict[str, list[SequenceSample]]:
    """logits: [sum of targets, vocab], the requests' rows in order."""
    if not requests:
        return {}
    targets = torch.tensor([t for r in requests for t in r.target_token_ids], device=logits.device)
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, targets[:, None]).squeeze(-1)
    k = max(r.num_top_tokens for r in requests)
    top = top_logprobs(logprobs, chosen, max(k, 1))
    chosen_list = chosen.tolist()
    scored: dict[str, list[SequenceSample]] = {}
    row = 0
    for request in requests:
        samples = []
        for token_id in request.target_token_ids:
            rank, top_ids, top_values = top.row(row, request.num_top_tokens)
            samples.append(
                SequenceSample(request.seq_id, token_id, chosen_list[row], rank, top_ids, top_values)
            )
            row += 1
        scored[request.request_id] = samples
    return scored
