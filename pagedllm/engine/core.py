"""EngineCore: the scheduler and the executor, stepping requests by token ids (vLLM v1's EngineCore).

It knows nothing textual. Requests come in validated and tokenized (``EngineCoreRequest``, from
the frontend's ``Processor``); each step goes out as ``EngineCoreOutputs``: per sequence, the
token ids it gained, their logprobs when asked, and why it ended. The frontend's
``OutputProcessor`` turns those into text and ``RequestOutput``s, and ends a sequence whose text
completes a stop string through ``finish_sequences``. ``LLMEngine`` composes the three in one
process; ``pagedllm serve`` runs this core in a process of its own (``core_proc.py``), so only
these small messages cross the pipe.

A step reads::

    scheduler_output = scheduler.schedule()              who computes which tokens, block moves
    step = executor.execute_model(scheduler_output)      launched; samples arrive later
    runner_output = step.get()                           wait for the samples
    sampled = scheduler.update_from_output(...)          append tokens, fork best_of requests,
                                                         end what EOS/stop ids/lengths stop
    beam search's choice (beam_search.py), carried out by core/fanout.py
    EngineCoreOutputs

With ``async_scheduling`` the core launches step N + 1 before it waits for step N's samples, so
the host's work for one step overlaps the device's work for the other. A request that stops at
step N may then have had one more token computed by step N + 1: it is dropped, never returned
or counted. Requests whose next step depends on their newest token on the host (beam search, a
best_of request's first sample, which forks it) make the core wait for the step in flight before
it schedules the next. With ``pipeline_parallel_size`` P the core keeps P - 1 steps in flight,
each a different micro-batch (the scheduler keeps a request whose sample is in flight out of the
next step), so that every stage has one to run while the core waits for the oldest.

The price is latency: the next step is scheduled before a request arriving now can join it, so
its first token comes about one step later. Offline runs (``LLM``, the benchmarks) take the
throughput; ``pagedllm serve`` is synchronous unless asked (``--async-scheduling``).

A model step that raises (``execute_model`` or the wait for its samples) fails only the request
responsible: the core drops it, and the step in flight with it, and the scheduler tests their
requests again, in probes that run alone (``Scheduler.isolate_failure``), until one user request
fails alone. That one finishes with FINISHED_ERROR and an error; the others are recomputed and
lose nothing (greedy outputs are the ones of a run without the failure). The core gives up,
raising ExecutorDeadError from then on, only when nothing can run: the workers are gone, the
device reported a fault (after an illegal memory access its context is unusable), or a step
fails after MAX_REQUESTS_FAILED_IN_A_ROW requests were failed with no step succeeding between
(steps fail whatever runs in them: a broken model or device). An error anywhere else in a step
(scheduling, applying its samples) is a bug whose damage is unknown: it propagates as it is.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.request import (
    FINISH_REASONS,
    BeamSearchState,
    PendingHypothesis,
    Request,
    RequestGroup,
    RequestStatus,
)
from pagedllm.core.scheduler import PreemptionMode, Scheduler
from pagedllm.core.stop_conditions import stop_status
from pagedllm.engine.beam_search import beam_search_step
from pagedllm.engine.stats import EngineStats
from pagedllm.executor import get_executor_class
from pagedllm.executor.abstract import ExecutorDeadError
from pagedllm.lora.loader import LoRALoadGate
from pagedllm.step_io import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ModelRunnerOutput,
    SchedulerOutput,
    StepHandle,
)

logger = logging.getLogger(__name__)

# User requests failed one after another, with no model step succeeding between, after which a
# failed step makes the core give up. Bad requests among good ones leave successes between
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
    """Marks what the core can isolate: an error of the workers' step. Dead workers are not
    (the executor stays dead, and says so)."""
    try:
        yield
    except ExecutorDeadError:
        raise
    except Exception as error:
        raise _StepFailed(error) from error


@dataclass
class _LiveRequest:
    """A user request the core runs: its group of sequences, and beam search's state."""

    group: RequestGroup
    beams: BeamSearchState | None
    # Why the scheduler ended it early, once it did.
    error: str | None = None


class EngineCore:
    """Requests in as token ids, one continuous-batching step at a time, token ids out."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = get_executor_class(config)(config)
        num_gpu_blocks, num_cpu_blocks = self.executor.determine_num_available_blocks()
        self._check_cache_fits(num_gpu_blocks)
        self.executor.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.scheduler_block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            enable_prefix_caching=config.cache_config.enable_prefix_caching,
            sliding_window=self.executor.get_kv_cache_spec().sliding_window,
            num_sink_tokens=config.model_config.attention_sinks,
            speculative_config=config.speculative_config,
            ngram_on_worker=config.drafts_on_worker,
            max_loras=config.lora_config.max_loras if config.lora_config else None,
            num_state_slots=self.executor.get_kv_cache_spec().num_state_slots,
            pipeline_parallel_size=config.parallel_config.pipeline_parallel_size,
        )
        # With enable_lora: requests whose adapter the workers are still reading wait here.
        self.lora_gate = LoRALoadGate(self.executor.collective_rpc) if config.lora_config else None
        # Live requests, by the caller's id.
        self.requests: dict[str, _LiveRequest] = {}
        # Steps launched but not yet applied, oldest first: none after a step without
        # asynchronous scheduling, else one, or one per pipeline stage but the last (so that
        # every stage has a micro-batch while the core waits for the oldest).
        self._in_flight: deque[tuple[SchedulerOutput, StepHandle]] = deque()
        pp = config.parallel_config.pipeline_parallel_size
        self.max_in_flight = max(pp - 1, 1) if config.async_scheduling else 0
        # User requests failed since the last model step that succeeded.
        self._num_failed_in_a_row = 0
        # Set once the core gave up: why (every later step raises ExecutorDeadError with it).
        self._dead_reason: str | None = None

    def _check_cache_fits(self, num_gpu_blocks: int) -> None:
        block_size = self.config.scheduler_block_size
        max_model_len = self.config.model_config.max_model_len
        if num_gpu_blocks * block_size < max_model_len:
            raise ValueError(
                f"the KV cache holds {num_gpu_blocks * block_size} tokens ({num_gpu_blocks} blocks of "
                f"{block_size}), fewer than one sequence of max_model_len={max_model_len}: lower "
                "max_model_len or give the cache more memory (kv_cache_memory, gpu_memory_utilization "
                "or num_kv_blocks)"
            )

    # --- requests ---------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated request (the frontend's processor checked it)."""
        params = request.sampling_params
        first = Request(
            self.scheduler.new_req_id(),
            request.prompt_token_ids,
            params,
            self.config.scheduler_block_size,
            request.arrival_time,
            request.request_id,
            request.eos_token_ids,
            request.lora_request,
        )
        first.group.reports_each_token = request.reports_each_token
        beams = BeamSearchState(beam_width=params.best_of) if params.use_beam_search else None
        self.requests[request.request_id] = _LiveRequest(first.group, beams)
        if self.lora_gate is None or self.lora_gate.admit(first):
            self.scheduler.add_request(first)

    def abort_requests(self, request_ids: Iterable[str]) -> EngineCoreOutputs:
        """End requests wherever they are; their blocks are free when this returns. Returns the
        tokens not reported yet of those reported only at their end (for their final outputs).
        Call it between steps, from the thread that steps."""
        out = EngineCoreOutputs()
        for request_id in request_ids:
            live = self.requests.pop(request_id, None)
            if live is not None:
                for seq in live.group.members:
                    if unreported := _unreported_tokens(seq):
                        index, cumulative = seq.output_index, seq.cumulative_logprob
                        out.outputs.append(EngineCoreOutput(request_id, index, unreported, None, cumulative))
                if self.lora_gate is not None:
                    self.lora_gate.discard(live.group.members)
                self.scheduler.finish_requests(list(live.group.members), RequestStatus.FINISHED_ABORTED)
        return out

    def finish_sequences(self, stopped: Iterable[tuple[str, int]]) -> None:
        """End sequences, by (request_id, output index), that the frontend stopped (a stop string);
        a request whose last sequence ends is over."""
        for request_id, index in stopped:
            live = self.requests.get(request_id)
            if live is None:
                continue
            seqs = [seq for seq in live.group.members if seq.output_index == index]
            self.scheduler.finish_requests(seqs, RequestStatus.FINISHED_STOPPED)
            if not live.group.members:
                del self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._in_flight)

    # --- the step ---------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """Run one iteration of continuous batching; return what its sequences gained, and which
        requests ended (failed ones included: see the module docstring). Raises
        ExecutorDeadError once the core gave up."""
        if self._dead_reason is not None:
            raise ExecutorDeadError(self._dead_reason)
        out = EngineCoreOutputs()
        if self.lora_gate is not None:
            self._admit_loaded_adapters()
        scheduler_output = None
        try:
            if self._in_flight and self.scheduler.has_requests_needing_host():
                self._apply_in_flight(out, len(self._in_flight))
            scheduler_output = self.scheduler.schedule()
            if self.scheduler.queues.stopped:
                self._report_stopped(out)
            launched = None
            if (
                scheduler_output.has_forward
                or _has_cache_ops(scheduler_output)
                or scheduler_output.finished_req_ids
            ):
                with _model_step():
                    launched = self.executor.execute_model(scheduler_output)
            if launched is not None and scheduler_output.has_forward:
                self._in_flight.append((scheduler_output, launched))
                self._apply_in_flight(out, len(self._in_flight) - self.max_in_flight)
            elif self._in_flight:  # nothing new: the oldest step's samples let the next one run
                self._apply_in_flight(out, 1)
        except _StepFailed as failure:
            # Neither the step that raised nor the others launched are applied: their requests'
            # progress since the last applied step is gone.
            dropped = [] if scheduler_output is None else [scheduler_output]
            dropped += [step for step, _ in self._in_flight if step is not scheduler_output]
            self._in_flight.clear()
            self._handle_failed_step(failure.error, dropped, out)
        return out

    def _apply_in_flight(self, out: EngineCoreOutputs, count: int) -> None:
        """Apply the ``count`` oldest steps in flight, oldest first (a step whose samples fail
        stays in flight: the failure handling drops it)."""
        for _ in range(count):
            self._apply(*self._in_flight[0], out)
            self._in_flight.popleft()

    def _admit_loaded_adapters(self) -> None:
        """Requests whose adapter is now on every rank go to the scheduler; those whose adapter
        failed to load end with its error (reported with the step's stopped requests)."""
        assert self.lora_gate is not None
        idle = not self._in_flight and not self.scheduler.has_unfinished_requests()
        ready, failed = self.lora_gate.poll(idle)
        for request in ready:
            self.scheduler.add_request(request)
        for request, error in failed:
            logger.error("request %s failed: %s", request.group.request_id, error)
            self.scheduler.add_request(request)
            self.scheduler.queues.stop([request], RequestStatus.FINISHED_ERROR, error)

    def _handle_failed_step(
        self, error: Exception, dropped: list[SchedulerOutput], out: EngineCoreOutputs
    ) -> None:
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
        failed = self._report_stopped(out)
        for request_id in failed:
            logger.error("request %s failed: %s", request_id, out.finished_requests[request_id])
        self._num_failed_in_a_row += len(failed)

    def _apply(self, scheduler_output: SchedulerOutput, launched: StepHandle, out: EngineCoreOutputs) -> None:
        """A step's samples: into the requests (the scheduler), out as what each sequence gained."""
        with _model_step():
            runner_output = launched.get()
        self._num_failed_in_a_row = 0
        requests = self.scheduler.queues.requests
        for req_id, prompt_logprobs in runner_output.prompt_logprobs.items():
            request = requests.get(req_id)
            if request is not None:  # read before the samples: a sample may end it
                out.prompt_logprobs[request.group.request_id] = prompt_logprobs
        sampled = self.scheduler.update_from_output(scheduler_output, runner_output)
        top_tokens = runner_output.top_tokens
        logprobs = runner_output.logprobs
        token_ids = runner_output.sampled_token_ids
        outputs = out.outputs
        ended: list[_LiveRequest] = []
        # One entry per appended token, in order: a step that verified drafts appends several to a
        # request, in consecutive entries, and only the last of them may have ended it.
        appended = sampled.appended
        for i, (request, row) in enumerate(appended):
            group = request.group
            last = i + 1 == len(appended) or appended[i + 1][0] is not request
            finish_reason = FINISH_REASONS.get(request.status) if last else None
            if group.reports_each_token:
                new_token_ids = [token_ids[row]]
                new_logprobs = None
                if group.sampling_params.logprobs is not None:
                    rank, top_ids, top_logprobs = top_tokens[row]
                    new_logprobs = [(logprobs[row], rank, top_ids, top_logprobs)]
            elif last and (not group.num_reported_tokens or finish_reason is not None):
                new_token_ids, new_logprobs = _unreported_tokens(request), None
            else:
                new_token_ids = None  # reported at its end
            if new_token_ids is not None:
                outputs.append(
                    EngineCoreOutput(
                        group.request_id,
                        request.output_index,
                        new_token_ids,
                        new_logprobs,
                        request.cumulative_logprob,
                        finish_reason,
                        request.stop_reason if last else None,
                    )
                )
            if request.output_index == 0 and len(request.output_token_ids) == 1:  # its first token
                out.first_scheduled[group.request_id] = request.first_scheduled_time
            if not group.members:
                ended.append(self.requests[group.request_id])
        for request, vector in sampled.pooled:
            group = request.group
            outputs.append(
                EngineCoreOutput(group.request_id, 0, [], None, 0.0, "stop", pooling_output=vector)
            )
            out.first_scheduled[group.request_id] = request.first_scheduled_time
            ended.append(self.requests[group.request_id])
        if sampled.beams:
            self._apply_beam_search(sampled.beams, runner_output, out)
        for live in ended:
            self._end(live, out)

    def _apply_beam_search(
        self, beams: list[tuple[Request, int]], runner_output: ModelRunnerOutput, out: EngineCoreOutputs
    ) -> None:
        by_request: dict[str, list[tuple[Request, list[int], list[float]]]] = {}
        for request, row in beams:
            _, top_ids, top_logprobs = runner_output.top_tokens[row]
            by_request.setdefault(request.group.request_id, []).append((request, top_ids, top_logprobs))
        for request_id, candidates in by_request.items():
            live = self.requests[request_id]
            # Its first beam step (the beams take their tokens in it): as for a sampled request's
            # first token, the first scheduling time goes out with it.
            first = candidates[0][0]
            if not first.output_token_ids:
                out.first_scheduled[request_id] = first.first_scheduled_time
            seqs = self._beam_step(live, candidates)
            out.replaced_request_ids.add(request_id)
            for index, seq in enumerate(seqs):
                out.outputs.append(
                    EngineCoreOutput(
                        request_id,
                        index,
                        seq.output_token_ids.copy(),
                        None,
                        seq.cumulative_logprob,
                        seq.status.finish_reason,
                        seq.stop_reason,
                    )
                )
            if not live.group.members:
                self._end(live, out)

    def _beam_step(
        self, live: _LiveRequest, beams: list[tuple[Request, list[int], list[float]]]
    ) -> list[Request]:
        """Beam search's step for one request (``beam_search.py`` decides, the fan-out carries it
        out); returns its sequences now: the live beams, or, once it is done, its hypotheses."""
        params = live.group.sampling_params
        beam_state = live.beams
        assert beam_state is not None
        num_eos = len(live.group.eos_token_ids)
        # The most tokens a beam can reach: it bounds how much a live beam can still improve.
        max_context_len = self.scheduler.max_context_len
        room = (max_context_len or self.config.model_config.max_model_len) - beams[0][0].num_prompt_tokens
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
                beam_state.finished[index] = (score, fanout.new_hypothesis(kept))
        live_beams = fanout.apply_beam_step([b for b, _, _ in beams], decision.extensions)
        beam_state.beam_scores = dict(zip((b.req_id for b in live_beams), decision.scores))
        if not decision.done:
            return live_beams
        self.scheduler.finish_requests(live_beams, RequestStatus.FINISHED_ABORTED)
        return [seq for _, seq in beam_state.finished]

    def _report_stopped(self, out: EngineCoreOutputs) -> list[str]:
        """Requests the scheduler ended without running them to their end; returns their ids."""
        touched: dict[str, _LiveRequest] = {}
        for request in self.scheduler.queues.stopped:
            live = self.requests.get(request.group.request_id)
            if live is None:
                continue
            live.error = request.error
            touched[live.group.request_id] = live
            out.outputs.append(
                EngineCoreOutput(
                    live.group.request_id,
                    request.output_index,
                    _unreported_tokens(request),
                    None,
                    request.cumulative_logprob,
                    request.status.finish_reason,
                    request.stop_reason,
                )
            )
        self.scheduler.queues.stopped.clear()
        ended = [live for live in touched.values() if not live.group.members]
        for live in ended:
            self._end(live, out)
        return [live.group.request_id for live in ended]

    def _end(self, live: _LiveRequest, out: EngineCoreOutputs) -> None:
        request_id = live.group.request_id
        if self.requests.pop(request_id, None) is not None:
            out.finished_requests[request_id] = live.error
            metrics = live.group.metrics
            if metrics.spec_num_draft_tokens:
                out.spec_decoding[request_id] = (
                    metrics.spec_num_draft_tokens,
                    metrics.spec_num_accepted_tokens,
                )

    def check_health(self) -> None:
        """Raise ExecutorDeadError when a worker is gone or the core gave up."""
        if self._dead_reason is not None:
            raise ExecutorDeadError(self._dead_reason)
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the workers (their processes, with tensor parallelism); the core is unusable after."""
        self.executor.shutdown()

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
            spec_decoding=None if scheduler.spec_decoding is None else scheduler.spec_decoding.stats(),
        )


def _has_cache_ops(scheduler_output: SchedulerOutput) -> bool:
    return bool(
        scheduler_output.blocks_to_swap_in
        or scheduler_output.blocks_to_swap_out
        or scheduler_output.blocks_to_copy
        or scheduler_output.state_slots_to_copy
    )


def _unreported_tokens(request: Request) -> list[int]:
    """The tokens of a request reported only at its first token and its end that the frontend
    has not had yet (marked reported now); none for one reported token by token."""
    group = request.group
    if group.reports_each_token:
        return []
    tokens = request.output_token_ids[group.num_reported_tokens :]
    group.num_reported_tokens = len(request.output_token_ids)
    return tokens
