"""LLMEngine: requests in, one continuous-batching step at a time, RequestOutputs out.

A step (DESIGN.md section 2): the scheduler picks this step's tokens and the block moves they
need; the executor's workers do the moves and run the model once over every scheduled token; the
engine appends the sampled tokens (forking a request's sequences after its first sample),
detokenizes them, checks stop conditions and frees what finished.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import PreemptionMode, ScheduledSequenceGroup, Scheduler
from pagedllm.detokenizer import init_detokenizer_state
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.beam_search import BeamSearchState, num_candidates
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.stop_checker import StopChecker
from pagedllm.executor.uniproc_executor import UniProcExecutor
from pagedllm.outputs import RequestOutput
from pagedllm.request_validation import validate_request
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.tokenizer import get_eos_token_ids, get_tokenizer
from pagedllm.worker.execute_request import ExecuteModelRequest, ScheduledSequence, SequenceGroupMetadata
from pagedllm.worker.request_logits import has_logits_processors

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """A snapshot of the engine's queues, cache and counters."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_gpu_blocks: int
    num_gpu_blocks: int
    num_free_cpu_blocks: int
    num_cpu_blocks: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    # Tokens computed by prefills (prompts, and prompt + outputs recomputed after preemption).
    num_prefill_tokens: int
    # Tokens sampled.
    num_generation_tokens: int
    # Prompt tokens found in the prefix cache, over prompt tokens looked up (0 when it is off).
    prefix_cache_hit_rate: float

    @property
    def gpu_cache_usage(self) -> float:
        return 1.0 - self.num_free_gpu_blocks / max(self.num_gpu_blocks, 1)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_config = config.model_config
        self.tokenizer = get_tokenizer(model_config)
        self.executor = UniProcExecutor(config)
        num_gpu_blocks, num_cpu_blocks = self.executor.determine_num_available_blocks()
        self._check_cache_fits(num_gpu_blocks)
        self.executor.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config.block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            enable_prefix_caching=config.cache_config.enable_prefix_caching,
        )
        self.eos_token_ids = get_eos_token_ids(model_config, self.tokenizer)
        self.structured_output_manager = (
            None
            if self.tokenizer is None
            else StructuredOutputManager(self.tokenizer, model_config.vocab_size, self.eos_token_ids)
        )
        self._seq_counter = itertools.count()
        self.output_processor = OutputProcessor(
            self.scheduler,
            self.tokenizer,
            StopChecker(model_config.max_model_len, self.eos_token_ids),
            self._seq_counter,
        )
        # Live requests, by id.
        self.requests: dict[str, SequenceGroup] = {}
        # Requests refused without running (prompt too long): reported by the next step.
        self._finished_at_once: list[SequenceGroup] = []
        # Requests ended since the last step, so workers can drop their state.
        self._finished_request_ids: list[str] = []
        self._num_prefill_tokens = 0
        self._num_generation_tokens = 0

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def _check_cache_fits(self, num_gpu_blocks: int) -> None:
        block_size = self.config.cache_config.block_size
        max_model_len = self.config.model_config.max_model_len
        if num_gpu_blocks * block_size < max_model_len:
            raise ValueError(
                f"the KV cache holds {num_gpu_blocks * block_size} tokens ({num_gpu_blocks} blocks of "
                f"{block_size}), fewer than one sequence of max_model_len={max_model_len}: lower "
                "max_model_len or give the cache more memory (kv_cache_memory, gpu_memory_utilization "
                "or num_kv_blocks)"
            )

    # --- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        stream: bool = True,
    ) -> None:
        """Queue a request. Bad input raises ValueError here and leaves the engine unchanged.

        A prompt longer than max_model_len is accepted but never scheduled: the next step
        returns it finished, with ``RequestOutput.error`` saying why.

        With ``stream`` (the default) the request's output comes back after every step that
        extends it; without, only once it finishes, and its text is decoded once at the end
        (incrementally only when stop strings need it), which saves host time every step.
        """
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = sampling_params or SamplingParams()
        token_ids = self._prompt_token_ids(prompt, prompt_token_ids)
        token_ids = validate_request(
            params,
            token_ids,
            self.config,
            self.num_gpu_blocks,
            len(self.eos_token_ids),
            self.tokenizer,
            self.structured_output_manager,
        )
        seq = Sequence(next(self._seq_counter), token_ids, self.config.cache_config.block_size)
        if self.tokenizer is not None:
            init_detokenizer_state(seq)
        seq_group = SequenceGroup(
            request_id, [seq], params, arrival_time=arrival_time or time.time(), prompt=prompt, stream=stream
        )
        if params.use_beam_search:
            seq_group.beam_state = BeamSearchState(beam_width=params.best_of)
        max_model_len = self.config.model_config.max_model_len
        if len(token_ids) > max_model_len:
            seq_group.error = f"prompt has {len(token_ids)} tokens, more than max_model_len={max_model_len}"
            seq.status = SequenceStatus.FINISHED_IGNORED
            self._finished_at_once.append(seq_group)
            return
        self.requests[request_id] = seq_group
        self.scheduler.add_seq_group(seq_group)

    def _prompt_token_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (skip_tokenizer_init): give prompt_token_ids")
            prompt_token_ids = self.tokenizer(prompt)["input_ids"]
        return prompt_token_ids

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """End requests wherever they are; their blocks are free when this returns."""
        request_ids = {request_id} if isinstance(request_id, str) else set(request_id)
        self._finished_at_once = [g for g in self._finished_at_once if g.request_id not in request_ids]
        for seq_group in self.scheduler.abort_seq_group(request_ids):
            self._finish_request(seq_group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._finished_at_once)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests) + len(self._finished_at_once)

    # --- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration of continuous batching.

        Returns an output for each request that finished in this step, and for each streaming
        request (``add_request(stream=True)``) that got new tokens.
        """
        outputs = [RequestOutput.from_seq_group(g) for g in self._finished_at_once]
        self._finished_at_once.clear()
        scheduler_outputs = self.scheduler.schedule()
        for seq_group in scheduler_outputs.ignored_seq_groups:
            self._finish_request(seq_group)
            outputs.append(RequestOutput.from_seq_group(seq_group))
        if scheduler_outputs.is_empty():
            return outputs

        request = ExecuteModelRequest(
            seq_groups=[self._group_metadata(s) for s in scheduler_outputs.scheduled_seq_groups],
            blocks_to_swap_out=scheduler_outputs.blocks_to_swap_out,
            blocks_to_swap_in=scheduler_outputs.blocks_to_swap_in,
            blocks_to_copy=scheduler_outputs.blocks_to_copy,
            finished_request_ids=self._finished_request_ids,
        )
        self._finished_request_ids = []
        output = self.executor.execute_model(request)

        now = time.time()
        block_manager = self.scheduler.block_manager
        for scheduled in scheduler_outputs.scheduled_seq_groups:
            seq_group = scheduled.seq_group
            for seq in seq_group.seqs:
                num_new_tokens = scheduled.num_new_tokens.get(seq.seq_id)
                if num_new_tokens is None:
                    continue
                if seq.is_prefill():
                    self._num_prefill_tokens += num_new_tokens
                seq.num_computed_tokens += num_new_tokens
                block_manager.mark_computed(seq)
            samples = output.samples.get(seq_group.request_id)
            self.output_processor.process(
                seq_group, samples, output.prompt_logprobs.get(seq_group.request_id)
            )
            if samples:
                self._num_generation_tokens += len(samples)
                metrics = seq_group.metrics
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                metrics.last_token_time = now
            finished = seq_group.is_finished()
            if finished:
                self.output_processor.finalize_text(seq_group)
                self._finish_request(seq_group, now)
            if finished or (samples and seq_group.stream):
                outputs.append(RequestOutput.from_seq_group(seq_group))
        self.scheduler.free_finished_seq_groups()
        return outputs

    def _group_metadata(self, scheduled: ScheduledSequenceGroup) -> SequenceGroupMetadata:
        seq_group = scheduled.seq_group
        params = seq_group.sampling_params
        block_manager = self.scheduler.block_manager
        has_penalties = (
            params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0
            or has_logits_processors(params)
        )
        seqs = []
        for seq in seq_group.seqs:
            num_new_tokens = scheduled.num_new_tokens.get(seq.seq_id)
            if num_new_tokens is None:
                continue
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens
            seqs.append(
                ScheduledSequence(
                    seq_id=seq.seq_id,
                    token_ids=seq.get_token_ids_slice(start, end),
                    num_computed_tokens=start,
                    block_table=block_manager.get_block_table(seq),
                    do_sample=end == seq.get_len(),
                    num_output_tokens=seq.num_output_tokens,
                    output_token_ids=seq.output_token_ids if has_penalties else None,
                )
            )
        metadata = SequenceGroupMetadata(
            request_id=seq_group.request_id,
            sampling_params=params,
            seqs=seqs,
            num_samples=1 if seq_group.is_forked or params.use_beam_search else params.best_of,
            stop_token_ids=self._min_tokens_stop_ids(params),
            prompt_token_ids=seq_group.prompt_token_ids if params.repetition_penalty != 1.0 else None,
            num_top_tokens=max(params.logprobs or 0, self._num_beam_candidates(params)),
        )
        if params.prompt_logprobs is not None:
            self._add_prompt_logprob_positions(seq_group, seqs, metadata)
        return metadata

    def _min_tokens_stop_ids(self, params: SamplingParams) -> list[int]:
        if not params.min_tokens:
            return []
        return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids))

    def _num_beam_candidates(self, params: SamplingParams) -> int:
        if not params.use_beam_search:
            return 0
        return num_candidates(params.best_of, 0 if params.ignore_eos else len(self.eos_token_ids))

    @staticmethod
    def _add_prompt_logprob_positions(
        seq_group: SequenceGroup, seqs: list[ScheduledSequence], metadata: SequenceGroupMetadata
    ) -> None:
        """Positions of this step that score prompt tokens not scored yet (a recomputed prompt is
        not scored twice). Position p scores prompt token p + 1."""
        prompt = seq_group.prompt_token_ids
        num_scored = len(seq_group.prompt_logprobs or [None])
        for seq in seqs:
            start = max(seq.num_computed_tokens, num_scored - 1)
            end = min(seq.num_computed_tokens + len(seq.token_ids), len(prompt) - 1)
            positions = list(range(start, end))
            metadata.prompt_logprob_positions += positions
            metadata.prompt_logprob_targets += [prompt[p + 1] for p in positions]
        metadata.num_prompt_logprobs = seq_group.sampling_params.prompt_logprobs or 0

    def _finish_request(self, seq_group: SequenceGroup, now: float | None = None) -> None:
        seq_group.metrics.finished_time = now or time.time()
        if self.requests.pop(seq_group.request_id, None) is not None:
            self._finished_request_ids.append(seq_group.request_id)

    # --- introspection ----------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_swapped=len(scheduler.swapped),
            num_free_gpu_blocks=scheduler.block_manager.get_num_free_gpu_blocks(),
            num_gpu_blocks=self.num_gpu_blocks,
            num_free_cpu_blocks=scheduler.block_manager.get_num_free_cpu_blocks(),
            num_cpu_blocks=self.num_cpu_blocks,
            num_preemptions_recompute=scheduler.num_preemptions[PreemptionMode.RECOMPUTE],
            num_preemptions_swap=scheduler.num_preemptions[PreemptionMode.SWAP],
            num_prefill_tokens=self._num_prefill_tokens,
            num_generation_tokens=self._num_generation_tokens,
            prefix_cache_hit_rate=scheduler.block_manager.get_prefix_cache_hit_rate(),
        )
