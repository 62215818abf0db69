"""LLMEngine: requests in, one continuous-batching step at a time, RequestOutputs out.

A step reads::

    scheduler_output = scheduler.schedule()              who computes which tokens, block moves
    step = executor.execute_model(scheduler_output)      launched; samples arrive later
    runner_output = step.get()                           wait for the samples
    sampled = scheduler.update_from_output(...)          append tokens, fork best_of requests,
                                                         end what EOS/stop ids/lengths stop
    detokenize and match stop strings; finish what ended (the scheduler frees their blocks)
    emit RequestOutputs

With ``async_scheduling`` the engine launches step N + 1 before it waits for step N's samples,
so the host's work for one step overlaps the device's work for the other. A request that stops
at step N may then have had one more token computed by step N + 1: it is dropped, never returned
or counted. Requests whose next step depends on their newest token on the host (beam search, a
best_of request's first sample, which forks it) make the engine wait for the step in flight
before it schedules the next.

The price is latency: the next step is scheduled before a request arriving now can join it, so
its first token comes about one step later. Offline runs (``LLM``, the benchmarks) take the
throughput; ``pagedllm serve`` is synchronous unless asked (``--async-scheduling``).

A model step that raises (``execute_model`` or the wait for its samples) fails only the request
responsible: the engine drops it, and the step in flight with it, and the scheduler tests their
requests again, in probes that run alone (``Scheduler.isolate_failure``), until one user request
fails alone. That one finishes with FINISHED_ERROR and ``RequestOutput.error``; the others are
recomputed and lose nothing (greedy outputs are the ones of a run without the failure). The engine
gives up, raising ExecutorDeadError from then on, only when nothing can run: the workers are gone,
the device reported a fault (after an illegal memory access its context is unusable), or a step
fails after MAX_REQUESTS_FAILED_IN_A_ROW requests were failed with no step succeeding between
(steps fail whatever runs in them: a broken model or device). An error anywhere else in a step
(scheduling, applying its samples) is a bug whose damage is unknown: it propagates as it is.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.request import BeamSearchState, PendingHypothesis, Request, RequestState, RequestStatus
from pagedllm.core.scheduler import PreemptionMode, SampledRequests, Scheduler
from pagedllm.core.stop_conditions import stop_status
from pagedllm.detokenizer import init_detokenizer_state
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.beam_search import beam_search_step
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.executor import get_executor_class
from pagedllm.executor.abstract import ExecutorDeadError
from pagedllm.lora.registry import LoRARegistry
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.request_validation import validate_request
from pagedllm.sampling_params import SamplingParams
from pagedllm.step_io import ModelRunnerOutput, SchedulerOutput, StepHandle
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.tokenizer import get_eos_token_ids, get_tokenizer

logger = logging.getLogger(__name__)

# User requests failed one after another, with no model step succeeding between, after which a
# failed step makes the engine give up. Bad requests among good ones leave successes between
# their verdicts (a probe of good ones succeeds), so such a run means that steps fail whatever
# runs in them (a broken model or device), unless that many bad requests came back to back. Runs
# of failed steps are bounded without a count of their own: a failed probe convicts one request
# or halves a set, so at most about log2(max_num_seqs) + 2 steps fail between two verdicts.
MAX_REQUESTS_FAILED_IN_A_ROW = 4


class _StepFailed(Exception):
    """A model step raised ``error``: launching it, or waiting for its samples."""

    def __init__(self, error: Exception) -> None:
        super().__init__(repr(error))
        self.error = error


@contextlib.contextmanager
def _model_step() -> Iterator[None]:
    """Marks what the engine can isolate: an error of the workers' step. Dead workers are not
    (the executor stays dead, and says so)."""
    try:
        yield
    except ExecutorDeadError:
        raise
    except Exception as error:
        raise _StepFailed(error) from error


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
        self.executor = get_executor_class(config)(config)
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
            sliding_window=self.executor.get_kv_cache_spec().sliding_window,
            num_sink_tokens=model_config.attention_sinks,
            max_loras=config.lora_config.max_loras if config.lora_config else None,
        )
        self.lora_registry = LoRARegistry(config.lora_config, model_config.hf_config)
        self.eos_token_ids = get_eos_token_ids(model_config, self.tokenizer)
        self.structured_output_manager = StructuredOutputManager.for_model(model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.async_scheduling = config.async_scheduling
        # Live requests, by the caller's id; and the request each sequence belongs to.
        self.requests: dict[str, RequestState] = {}
        self._state_of: dict[int, RequestState] = {}
        # Requests refused without running (prompt too long): reported by the next step.
        self._finished_at_once: list[RequestState] = []
        # The step launched but not yet applied (asynchronous scheduling).
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        # User requests failed since the last model step that succeeded.
        self._num_failed_in_a_row = 0
        # Set once the engine gave up: why (every later step raises ExecutorDeadError with it).
        self._dead_reason: str | None = None

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
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request. Bad input raises ValueError here and leaves the engine unchanged.

        ``lora_request`` runs it with that LoRA adapter (``enable_lora``); the adapter is checked
        against the base model here, once.

        A prompt longer than max_model_len is accepted but never scheduled: the next step
        returns it finished, with ``RequestOutput.error`` saying why.

        With ``stream`` (the default) the request's output comes back after every step that
        extends it; without, only once it finishes, and its text is decoded once at the end
        (incrementally only when stop strings need it), which saves host time every step.
        """
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = sampling_params or SamplingParams()
        self.lora_registry.check(lora_request)
        token_ids = validate_request(
            params,
            self._prompt_token_ids(prompt, prompt_token_ids),
            self.config,
            self.num_gpu_blocks,
            len(self.eos_token_ids),
            self.tokenizer,
            self.structured_output_manager,
        )
        arrival_time = arrival_time or time.time()
        request = Request(
            self.scheduler.new_req_id(),
            token_ids,
            params,
            self.config.cache_config.block_size,
            arrival_time,
            request_id,
            self.eos_token_ids,
            lora_request,
        )
        if self.tokenizer is not None:
            init_detokenizer_state(request)
        state = RequestState(request_id, prompt, token_ids, params, [request], stream, arrival_time)
        if params.use_beam_search:
            state.beam_state = BeamSearchState(beam_width=params.best_of)
        max_model_len = self.config.model_config.max_model_len
        if len(token_ids) > max_model_len:
            state.error = f"prompt has {len(token_ids)} tokens, more than max_model_len={max_model_len}"
            request.status = RequestStatus.FINISHED_IGNORED
            self._finished_at_once.append(state)
            return
        self.requests[request_id] = state
        self._state_of[request.req_id] = state
        self.scheduler.add_request(request)

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

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """End requests wherever they are; their blocks are free when this returns. Returns the
        final output of each request that was still live (finish reason "abort", the tokens it
        had), which no step will return. Call it between steps, from the thread that steps."""
        request_ids = {request_id} if isinstance(request_id, str) else set(request_id)
        self._finished_at_once = [s for s in self._finished_at_once if s.request_id not in request_ids]
        aborted = []
        for rid in request_ids:
            state = self.requests.get(rid)
            if state is None:
                continue
            self.scheduler.finish_requests(_live(state), RequestStatus.FINISHED_ABORTED)
            self._retire(state)
            aborted.append(RequestOutput.from_state(state))
        return aborted

    def request_id_of(self, req_id: int) -> str | None:
        """The caller's id of the request an engine sequence belongs to (None once it ended)."""
        state = self._state_of.get(req_id)
        return None if state is None else state.request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._finished_at_once or self._in_flight)

    # --- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration of continuous batching.

        Returns an output for each request that finished (failed ones included: see the module
        docstring), and for each streaming request (``add_request(stream=True)``) that got new
        tokens, since the last call. Raises ExecutorDeadError once the engine gave up.
        """
        if self._dead_reason is not None:
            raise ExecutorDeadError(self._dead_reason)
        outputs = [RequestOutput.from_state(s) for s in self._finished_at_once]
        self._finished_at_once.clear()
        scheduler_output = None
        try:
            if self._in_flight is not None and (
                not self.async_scheduling or self.scheduler.has_requests_needing_host()
            ):
                outputs += self._apply(*self._in_flight)
                self._in_flight = None
            scheduler_output = self.scheduler.schedule()
            outputs += self._report_stopped()
            launched = None
            if (
                scheduler_output.has_forward
                or _has_cache_ops(scheduler_output)
                or scheduler_output.finished_req_ids
            ):
                with _model_step():
                    launched = self.executor.execute_model(scheduler_output)
            if self._in_flight is not None:
                outputs += self._apply(*self._in_flight)
                self._in_flight = None
            if launched is not None and scheduler_output.has_forward:
                if self.async_scheduling:
                    self._in_flight = (scheduler_output, launched)
                else:
                    outputs += self._apply(scheduler_output, launched)
        except _StepFailed as failure:
            # Neither the step that raised nor the other one launched is applied: their
            # requests' progress since the last applied step is gone.
            dropped = [] if scheduler_output is None else [scheduler_output]
            if self._in_flight is not None:
                dropped.append(self._in_flight[0])
                self._in_flight = None
            outputs += self._handle_failed_step(failure.error, dropped)
        return outputs

    def _handle_failed_step(self, error: Exception, dropped: list[SchedulerOutput]) -> list[RequestOutput]:
        """After a failed model step: give up on a real fault, else hand the dropped steps to the
        scheduler's isolation and report the requests it convicted."""
        if isinstance(error, torch.AcceleratorError):
            self._dead_reason = f"the device reported a fault: {error}"
        elif self._num_failed_in_a_row >= MAX_REQUESTS_FAILED_IN_A_ROW:
            self._dead_reason = (
                f"model steps fail whatever runs in them: {self._num_failed_in_a_row} requests failed "
                f"in a row, and the next step failed too: {error!r}"
            )
        if self._dead_reason is not None:
            logger.error("the engine gives up: %s", self._dead_reason)
            raise ExecutorDeadError(self._dead_reason) from error
        logger.warning("a model step failed (%r): its requests run again, apart, to find the culprit", error)
        self.scheduler.isolate_failure(
            dropped, f"a model step with this request in it failed, and failed again with it alone: {error!r}"
        )
        outputs = self._report_stopped()
        for output in outputs:
            logger.error("request %s failed: %s", output.request_id, output.error)
        self._num_failed_in_a_row += len(outputs)
        return outputs

    def _apply(self, scheduler_output: SchedulerOutput, launched: StepHandle) -> list[RequestOutput]:
        """A step's samples: into the requests, through detokenization and stop checks, out as
        the outputs of the requests they extended or ended."""
        with _model_step():
            runner_output = launched.get()
        self._num_failed_in_a_row = 0
        sampled = self.scheduler.update_from_output(scheduler_output, runner_output)
        now = time.time()
        touched: dict[str, RequestState] = {}
        for req_id, prompt_logprobs in runner_output.prompt_logprobs.items():
            state = self._state_of.get(req_id)
            if state is not None:
                self.output_processor.add_prompt_logprobs(state, prompt_logprobs)
        for parent, child in sampled.forked:
            state = self._state_of[parent.req_id]
            state.seqs.append(child)
            self._state_of[child.req_id] = state
        for request, row in sampled.appended:
            state = self._state_of[request.req_id]
            status = self.output_processor.process_token(state, request, runner_output, row)
            if status is not None and request.is_finished:
                # The core ended it at its length limit, on the token that completes the stop
                # string: the stop string wins (as vLLM's output processor has it).
                request.status = status
            elif status is not None:
                self.scheduler.finish_requests((request,), status)
            touched[state.request_id] = state
        self._apply_beam_search(sampled, runner_output, touched)
        outputs = []
        for state in touched.values():
            metrics = state.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                metrics.first_scheduled_time = state.seqs[0].first_scheduled_time
            metrics.last_token_time = now
            if state.is_finished():
                self.output_processor.finalize_text(state)
                self._retire(state, now)
                outputs.append(RequestOutput.from_state(state))
            elif state.stream:
                outputs.append(RequestOutput.from_state(state))
        return outputs

    def _apply_beam_search(
        self, sampled: SampledRequests, runner_output: ModelRunnerOutput, touched: dict[str, RequestState]
    ) -> None:
        by_state: dict[str, list[tuple[Request, list[int], list[float]]]] = {}
        for request, row in sampled.beams:
            _, top_ids, top_logprobs = runner_output.top_tokens[row]
            by_state.setdefault(self._state_of[request.req_id].request_id, []).append(
                (request, top_ids, top_logprobs)
            )
        for request_id, beams in by_state.items():
            state = self.requests[request_id]
            touched[request_id] = state
            self._beam_step(state, beams)

    def _beam_step(self, state: RequestState, beams: list[tuple[Request, list[int], list[float]]]) -> None:
        params = state.sampling_params
        beam_state = state.beam_state
        assert beam_state is not None
        num_eos = len(beams[0][0].group.eos_token_ids)
        # The most tokens a beam can reach: it bounds how much a live beam can still improve.
        max_context_len = self.scheduler.max_context_len
        room = (max_context_len or self.config.model_config.max_model_len) - len(state.prompt_token_ids)
        max_new_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        decision = beam_search_step(
            beam_state,
            params,
            beams,
            lambda beam, token_id: stop_status(beam, token_id, beam.num_output_tokens + 1, max_context_len),
            num_eos,
            max_new_tokens,
        )
        fanout = self.scheduler.fanout
        for index, (score, kept) in enumerate(beam_state.finished):
            if isinstance(kept, PendingHypothesis):
                hypothesis = fanout.new_hypothesis(kept)
                self.output_processor.detokenize(state, hypothesis)
                beam_state.finished[index] = (score, hypothesis)
        for beam, _, _ in beams:
            if beam.req_id not in decision.extensions:
                self._state_of.pop(beam.req_id, None)
        live = fanout.apply_beam_step([b for b, _, _ in beams], decision.extensions)
        for beam in live:
            self._state_of[beam.req_id] = state
            self.output_processor.detokenize(state, beam)
        beam_state.beam_scores = dict(zip((b.req_id for b in live), decision.scores))
        state.seqs = live
        if decision.done:
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
            for beam in live:
                self._state_of.pop(beam.req_id, None)
            hypotheses = [seq for _, seq in beam_state.finished]
            for index, seq in enumerate(hypotheses):
                seq.output_index = index
            state.seqs = hypotheses

    def _report_stopped(self) -> list[RequestOutput]:
        """Requests the scheduler ended without running them to their end."""
        outputs = []
        for request in self.scheduler.queues.stopped:
            state = self._state_of.get(request.req_id)
            if state is None:
                continue
            state.error = request.error
            if state.is_finished() and state.request_id in self.requests:
                self.output_processor.finalize_text(state)
                self._retire(state)
                outputs.append(RequestOutput.from_state(state))
        self.scheduler.queues.stopped.clear()
        return outputs

    def _retire(self, state: RequestState, now: float | None = None) -> None:
        state.metrics.finished_time = now or time.time()
        self.requests.pop(state.request_id, None)
        for seq in state.seqs:
            self._state_of.pop(seq.req_id, None)

    def check_health(self) -> None:
        """Raise ExecutorDeadError when a worker is gone or the engine gave up."""
        if self._dead_reason is not None:
            raise ExecutorDeadError(self._dead_reason)
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the workers (their processes, with tensor parallelism); the engine is unusable after."""
        self.executor.shutdown()

    # --- introspection ----------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_swapped=sum(
                len(group.members_in(RequestStatus.SWAPPED)) for group in scheduler.queues.swapped
            ),
            num_free_gpu_blocks=kv.get_num_free_gpu_blocks(),
            num_gpu_blocks=self.num_gpu_blocks,
            num_free_cpu_blocks=kv.get_num_free_cpu_blocks(),
            num_cpu_blocks=self.num_cpu_blocks,
            num_preemptions_recompute=scheduler.num_preemptions[PreemptionMode.RECOMPUTE],
            num_preemptions_swap=scheduler.num_preemptions[PreemptionMode.SWAP],
            num_prefill_tokens=scheduler.num_prefill_tokens,
            num_generation_tokens=scheduler.num_generation_tokens,
            prefix_cache_hit_rate=kv.get_prefix_cache_hit_rate(),
        )


def freeze_startup_heap() -> None:
    """Move every object alive now out of the garbage collector's reach, for a process that serves
    until it exits (the engine process, the server).

    Once torch, transformers and the model are loaded, a process holds a few hundred thousand
    objects that live as long as it does, and a full collection walks them all: about 100 ms on
    a fast host, 300 ms on a slow one, during which nothing else runs (W4 showed every request
    that arrived during one getting its first token 250 ms late). Frozen, they are never walked
    again; collections then see only what was allocated since (vLLM's engine core does the same).
    """
    gc.collect()
    gc.freeze()


def _live(state: RequestState) -> list[Request]:
    return [seq for seq in state.seqs if not seq.is_finished]


def _has_cache_ops(scheduler_output: SchedulerOutput) -> bool:
    return bool(
        scheduler_output.blocks_to_swap_in
        or scheduler_output.blocks_to_swap_out
        or scheduler_output.blocks_to_copy
    )
