"""LLMEngine: requests in, one continuous-batching step at a time, RequestOutputs out.

It composes the three parts of vLLM v1's engine in one process::

    Processor          validate, tokenize, compile a constraint   -> EngineCoreRequest
    EngineCore         schedule, execute, sample (token ids only)  -> EngineCoreOutputs
    OutputProcessor    text, stop strings, logprobs, output kind   -> RequestOutputs

A sequence whose text completes a stop string is ended by the output processor and then freed
in the core before the next step. ``pagedllm serve`` composes the same parts with the core in a
process of its own (``async_engine.py``, ``core_proc.py``). How a step runs, with or without
asynchronous scheduling, and what happens when one fails: ``core.py``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor, RequestState, SequenceState
from pagedllm.engine.pooling_output import resolve_pooling_params
from pagedllm.engine.processor import Processor
from pagedllm.engine.stats import EngineStats
from pagedllm.executor.abstract import Executor
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.step_io import EngineCoreRequest
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.tokenizer import get_tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = get_tokenizer(config.model_config)
        self.engine_core = EngineCore(config)
        self.num_gpu_blocks = self.engine_core.num_gpu_blocks
        self.processor = Processor(config, self.tokenizer, self.num_gpu_blocks)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Requests refused without running (prompt too long): reported by the next step.
        self._finished_at_once: list[RequestOutput] = []

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    @property
    def scheduler(self) -> Scheduler:
        return self.engine_core.scheduler

    @property
    def executor(self) -> Executor:
        return self.engine_core.executor

    @property
    def structured_output_manager(self) -> StructuredOutputManager | None:
        return self.processor.structured_output_manager

    @property
    def requests(self) -> dict[str, RequestState]:
        """Live requests, by the caller's id, as the frontend tracks them."""
        return self.output_processor.requests

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
        pooling_params: PoolingParams | None = None,
    ) -> None:
        """Queue a request. Bad input raises ValueError here and leaves the engine unchanged.

        A pooling model (runner="pooling") takes ``pooling_params`` (or none: the model's
        defaults) and no ``sampling_params``; its request finishes with a PoolingRequestOutput.

        ``lora_request`` runs it with that LoRA adapter (``enable_lora``); the adapter is checked
        against the base model here, once.

        A prompt longer than max_model_len is accepted but never scheduled: the next step
        returns it finished, with ``RequestOutput.error`` saying why.

        With ``stream`` (the default) the request's outputs come back after every step that
        extends it, shaped by ``sampling_params.output_kind``; without, only once it finishes
        (FINAL_ONLY), and its text is decoded once at the end (incrementally only when stop
        strings need it); unless it asked for logprobs or several sequences, the engine core then
        reports its first token and the rest at its end, not each token: both save host time
        every step.
        """
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        pooling_params = resolve_pooling_params(pooling_params, self.config)
        request = self.processor.process(
            request_id, prompt, sampling_params, prompt_token_ids, arrival_time, lora_request
        )
        state = new_request_state(request, prompt, stream, pooling_params)
        error = self.processor.too_long(request)
        if error is not None:
            self._finished_at_once.append(finish_refused(self.output_processor, state, error))
            return
        request.reports_each_token = state.needs_each_token
        self.output_processor.add_request(state)
        self.engine_core.add_request(request)

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """End requests wherever they are; their blocks are free when this returns. Returns the
        final output of each request that was still live (finish reason "abort", the tokens it
        had), which no step will return. Call it between steps, from the thread that steps."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._finished_at_once = [o for o in self._finished_at_once if o.request_id not in request_ids]
        # Tokens of requests reported only at their end, for their final outputs.
        self.output_processor.process_outputs(self.engine_core.abort_requests(request_ids))
        return self.output_processor.abort(request_ids)

    def request_id_of(self, req_id: int) -> str | None:
        """The caller's id of the request an engine sequence belongs to (None once it ended)."""
        request = self.scheduler.requests.get(req_id)
        return None if request is None else request.group.request_id

    def has_unfinished_requests(self) -> bool:
        return bool(
            self._finished_at_once
            or self.output_processor.has_unfinished_requests()
            or self.engine_core.has_unfinished_requests()
        )

    # --- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one iteration of continuous batching.

        Returns an output for each request that finished (failed ones included: see ``core.py``),
        and for each streaming request (``add_request(stream=True)``) that got new tokens, since
        the last call. Raises ExecutorDeadError once the engine gave up.
        """
        outputs, self._finished_at_once = self._finished_at_once, []
        step_outputs, stopped = self.output_processor.process_outputs(self.engine_core.step())
        if stopped:
            self.engine_core.finish_sequences(stopped)
        return outputs + step_outputs

    def check_health(self) -> None:
        """Raise ExecutorDeadError when a worker is gone or the engine gave up."""
        self.engine_core.check_health()

    def shutdown(self) -> None:
        """Stop the workers (their processes, with tensor parallelism); the engine is unusable after."""
        self.engine_core.shutdown()

    def get_stats(self) -> EngineStats:
        return self.engine_core.get_stats()

    def start_profile(self, torch_profiler: bool = True) -> None:
        """Start every rank's profile: the steps from here on are profiled on the device that runs
        them (worker/profiler.py); without ``torch_profiler``, only each step's start and end."""
        self.executor.collective_rpc("start_profile", (torch_profiler,))

    def stop_profile(self) -> list[dict[str, Any]]:
        """End the ranks' profiles; each rank's summary, in rank order (``WorkerProfiler.stop``)."""
        return self.executor.collective_rpc("stop_profile")


def new_request_state(
    request: EngineCoreRequest,
    prompt: str | None,
    stream: bool,
    pooling_params: PoolingParams | None = None,
) -> RequestState:
    """The frontend's state of a request the processor made: its outputs shaped by
    ``output_kind``, or FINAL_ONLY when the caller does not stream (or it is a pooling request,
    whose one output comes at its end)."""
    params = request.sampling_params
    stream = stream and pooling_params is None
    return RequestState(
        request.request_id,
        prompt,
        request.prompt_token_ids,
        params,
        params.output_kind if stream else RequestOutputKind.FINAL_ONLY,
        request.arrival_time,
        pooling_params=pooling_params,
    )


def finish_refused(output_processor: OutputProcessor, state: RequestState, error: str) -> RequestOutput:
    """The final output of a request that can never run: one empty sequence, finish reason
    "length", and ``error`` saying why."""
    state.error = error
    state.seqs.append(SequenceState(0, state.prompt_token_ids, finish_reason="length"))
    return output_processor.finish(state)


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
