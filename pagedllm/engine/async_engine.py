"""AsyncLLMEngine: an engine core served to asyncio code (the server), one stream per request.

```
event loop (this object: the frontend)          engine core loop (core_proc.py; a thread or a process)
--------------------------------------          ------------------------------------------------------
add_request(id, ...)  processor: validate,
    tokenize  ---AddRequest------------------>  applied between steps
    awaits its AddResult  <-------------------
async for out in stream  <--CoreOutputs-------  after every step: token ids, stats
    output processor: text, stop strings  --FinishSequences-->  (a stop string ended them)
abort(id)             --AbortRequests-------->  the request's blocks are free before the next step
```

The frontend (this object, on the event loop) owns everything textual: the processor validates
and tokenizes, the output processor detokenizes, matches stop strings and shapes each request's
outputs (``SamplingParams.output_kind``: the server streams DELTA outputs). The core deals in
token ids only. It runs in one of two places (vLLM v1's in-process and multiprocess clients):
- ``AsyncLLMEngine(engine)``: a thread of this process steps the given LLMEngine's core. The
  model's kernels release the GIL, but the host's half of each step shares it with the event loop.
- ``AsyncLLMEngine.in_engine_process(engine_args)`` (``pagedllm serve``'s default): the core
  lives in a process of its own; ops and messages are pickled over a pipe. The event loop's HTTP
  work then never delays a step, nor a step the event loop.

Either way only the core's thread calls the EngineCore, and only the event loop the processors,
so nothing needs a lock; messages come back to the event loop through
``loop.call_soon_threadsafe``.

Failures: when a model step raises, the LLMEngine finds the request responsible and fails only
that one: its stream raises ``RequestFailedError`` with the step's error, and every other stream
goes on as if nothing happened. When the engine gives up (a worker gone, a device fault, steps
failing whatever runs in them), the core loop raises, or the engine process dies, the engine is
dead: ``is_healthy`` turns False, every stream and every pending add gets
``AsyncEngineDeadError``, and new requests are refused with it (the server then exits non-zero,
for its supervisor to restart it).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_messages import (
    AbortRequests,
    AddRequest,
    AddResult,
    CoreMessage,
    CoreOp,
    CoreOutputs,
    FinishSequences,
    Heartbeat,
)
from pagedllm.engine.core_proc import EngineCoreLoop
from pagedllm.engine.dp_client import DataParallelCore
from pagedllm.engine.engine_process import (
    PROCESS_EXIT_TIMEOUT_S,
    ProcessCore,
    StartedEngineCore,
    start_engine_core,
)
from pagedllm.engine.llm_engine import LLMEngine, finish_refused, new_request_state
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.pooling_output import resolve_pooling_params
from pagedllm.engine.processor import Processor
from pagedllm.engine.stats import EngineStats
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The engine reports after every step, and every HEALTH_CHECK_INTERVAL_S while idle: heard of
# longer ago than this, it is stuck (stopped, or a step that does not end), and /health says so.
HEARTBEAT_TIMEOUT_S = 10.0


class AsyncEngineDeadError(RuntimeError):
    """The engine stopped serving: its loop failed, its process died, or it was shut down."""


class RequestFailedError(RuntimeError):
    """The engine failed this request: a model step raised whenever it ran (even alone)."""


class RequestStream:
    """The outputs of one request, in order, as an async iterator.

    With ``coalesce`` (cumulative outputs: text, token ids and logprobs so far), when the consumer
    falls behind the engine only the newest output matters: each iteration returns the latest one
    queued. Delta outputs are each returned. Iteration ends after the finished output, after an
    error (raised), or when the request is aborted.
    """

    _END = object()

    def __init__(self, request_id: str, coalesce: bool = True) -> None:
        self.request_id = request_id
        self.coalesce = coalesce
        # True once the last item (finished output, error or end) is queued.
        self.finished = False
        self._items: collections.deque[Any] = collections.deque()
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.finished:
            return
        self._items.append(item)
        if isinstance(item, BaseException) or item.finished:
            self.end()
        self._ready.set()

    def end(self) -> None:
        """End the stream after what is queued (without a finished output if none is)."""
        if not self.finished:
            self.finished = True
            self._items.append(self._END)
            self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        # Skip to the newest output queued: it holds everything the earlier ones do.
        while (
            self.coalesce
            and isinstance(item, RequestOutput)
            and self._items
            and isinstance(self._items[0], RequestOutput)
        ):
            item = self._items.popleft()
        if item is self._END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncLLMEngine:
    """An engine core served to asyncio code; see the module docstring.

    Args:
        engine: the engine a thread of this process steps. From now on only that thread may call
            it. (``in_engine_process`` builds one in a process of its own instead.)
        on_request_finished: called on the event loop with each request's finished output
            (metrics hook).

    Attributes:
        config: the engine's configuration.
        tokenizer: the frontend's tokenizer, for the event loop's use (the output processor
            detokenizes with it); None for token-id-only models.
        structured_output_manager: compiles output constraints, to refuse bad ones before they
            reach the engine (None without a tokenizer).
    """

    def __init__(
        self, engine: LLMEngine, on_request_finished: Callable[[RequestOutput], None] | None = None
    ) -> None:
        self._setup(_ThreadCore(engine), on_request_finished)

    @classmethod
    def in_engine_process(
        cls, engine_args: EngineArgs, on_request_finished: Callable[[RequestOutput], None] | None = None
    ) -> AsyncLLMEngine:
        """Start the engine in a process of its own; return once its model is loaded.

        Raises what building the engine raised there (ValueError for bad arguments). The process
        is spawned, so a script that calls this needs the ``if __name__ == "__main__":`` guard
        that any spawning program does. With ``engine_args.data_parallel_size`` N > 1, N engine
        processes serve behind this one frontend (dp_client.py).
        """
        return cls.from_started_core(start_engine_core(engine_args), on_request_finished)

    @classmethod
    def from_started_core(
        cls, started: StartedEngineCore, on_request_finished: Callable[[RequestOutput], None] | None = None
    ) -> AsyncLLMEngine:
        """Serve the engine core that ``start_engine_core`` started (``in_engine_process`` in two
        halves, so that the caller's own work overlaps the model's load); return once its model
        is loaded. Raises what building the engine raised there."""
        self = cls.__new__(cls)
        self._setup(started.wait(), on_request_finished)
        return self

    def _setup(
        self,
        core: _ThreadCore | ProcessCore | DataParallelCore,
        on_request_finished: Callable[[RequestOutput], None] | None,
    ) -> None:
        self._core = core
        # Several engine replicas (data_parallel_size > 1), or None for one engine.
        self.data_parallel = core if isinstance(core, DataParallelCore) else None
        self.on_request_finished = on_request_finished
        self.config: EngineConfig = core.config
        self.tokenizer: Tokenizer | None = core.tokenizer
        self.processor = Processor(core.config, core.tokenizer, core.num_gpu_blocks)
        self.output_processor = OutputProcessor(core.tokenizer)
        self.structured_output_manager: StructuredOutputManager | None = (
            self.processor.structured_output_manager
        )
        if self.data_parallel is not None:
            # The router counts a replica's load from the requests live here.
            self.data_parallel.router.track(self.output_processor.requests)
        self._loop: asyncio.AbstractEventLoop | None = None
        # Event loop side: the stream of each request not finished yet.
        self._streams: dict[str, RequestStream] = {}
        # Adds sent and not answered yet, by op id: a dying engine fails them rather than leaving
        # them hanging.
        self._adds: dict[int, asyncio.Future[None]] = {}
        self._op_ids = itertools.count()
        self._dead_error: AsyncEngineDeadError | None = None
        # When the engine last sent anything (event loop clock); see is_responsive.
        self.heartbeat_timeout_s = HEARTBEAT_TIMEOUT_S
        self._last_heard = time.monotonic()
        self.stats: EngineStats = core.initial_stats
        self.num_aborted_requests = 0
        self.num_failed_requests = 0

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine loop, delivering results to the running event loop."""
        if self._loop is not None:
            raise RuntimeError("the engine loop is already running")
        self._loop = asyncio.get_running_loop()
        self._last_heard = time.monotonic()
        self._core.start(self._deliver)

    async def shutdown(self, timeout: float = PROCESS_EXIT_TIMEOUT_S) -> None:
        """Stop the engine after its current step; unfinished streams get an error."""
        await asyncio.to_thread(self._core.close, timeout)
        self._set_dead(AsyncEngineDeadError("the engine was shut down"))

    def close(self) -> None:
        """Stop the engine (and its process or workers) from synchronous code; idempotent."""
        self._core.close(PROCESS_EXIT_TIMEOUT_S)

    @property
    def is_running(self) -> bool:
        return self._loop is not None and self._core.is_alive()

    @property
    def is_healthy(self) -> bool:
        return self.is_running and self._dead_error is None

    @property
    def seconds_since_heard(self) -> float:
        """Seconds since the engine last sent a step's outputs, an op's answer or a heartbeat (with
        data parallelism: the replica heard from least recently)."""
        if self.data_parallel is not None:
            return self.data_parallel.seconds_since_heard()
        return time.monotonic() - self._last_heard

    @property
    def is_responsive(self) -> bool:
        """Healthy, and heard from within ``heartbeat_timeout_s``. A stuck engine is not dead: it
        may go on (a SIGCONT), so this turns /health 503 without stopping anything."""
        return self.is_healthy and self.seconds_since_heard < self.heartbeat_timeout_s

    @property
    def engine_stats(self) -> list[EngineStats]:
        """Each engine core's latest stats, by data-parallel rank (``stats`` is their sum)."""
        return [self.stats] if self.data_parallel is None else list(self.data_parallel.engine_stats)

    def dead_reason(self) -> str:
        """Why the engine stopped serving ("" while it is healthy)."""
        if self._dead_error is not None:
            return str(self._dead_error)
        return "" if self.is_running else "the engine loop is not running"

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    # --- requests (event loop side) ---------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> RequestStream:
        """Queue a request; returns its output stream once the engine has taken it. Its outputs
        are shaped by ``sampling_params.output_kind`` (CUMULATIVE unless asked); a pooling
        model's request (``pooling_params``) has one, its PoolingRequestOutput.

        Raises ValueError for bad input (naming the field), before any output, or
        AsyncEngineDeadError.
        """
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        structured = None if sampling_params is None else sampling_params.structured_outputs
        manager = self.structured_output_manager
        if structured is not None and structured.compiled_grammar is None and manager is not None:
            # In the manager's threads: a large schema never stalls the event loop.
            structured.compiled_grammar = await asyncio.wrap_future(manager.compile(structured))
        pooling_params = resolve_pooling_params(pooling_params, self.config)
        request = self.processor.process(
            request_id, prompt, sampling_params, prompt_token_ids, arrival_time, lora_request
        )
        state = new_request_state(request, prompt, stream=True, pooling_params=pooling_params)
        request.reports_each_token = state.needs_each_token
        stream = RequestStream(request_id, coalesce=state.output_kind == RequestOutputKind.CUMULATIVE)
        error = self.processor.too_long(request)
        if error is not None:
            stream.put(finish_refused(self.output_processor, state, error))
            return stream
        self._streams[request_id] = stream
        self.output_processor.add_request(state)
        op_id = next(self._op_ids)
        future = asyncio.get_running_loop().create_future()
        self._adds[op_id] = future
        try:
            self._core.send(AddRequest(op_id, request))
            await future
        except asyncio.CancelledError:
            # The caller left while the add was on its way: the request may have been added since.
            self.abort(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            self.output_processor.abort([request_id])
            raise
        finally:
            self._adds.pop(op_id, None)
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """add_request, then yield its outputs; leaving the loop early aborts the request."""
        stream = await self.add_request(
            request_id, prompt, sampling_params, prompt_token_ids, arrival_time, lora_request
        )
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """End requests: their streams stop now, their blocks are freed before the next step."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        live = [request_id for request_id in ids if request_id in self._streams]
        for request_id in live:
            self._streams.pop(request_id).end()
        self.num_aborted_requests += len(self.output_processor.abort(live))
        self._send_abort(live)

    def fail_all_requests(self, message: str) -> None:
        """End every open stream with an error saying ``message`` (the server is going away), and
        abort the requests."""
        error = AsyncEngineDeadError(message)
        live = list(self._streams)
        for request_id in live:
            self._streams.pop(request_id).put(error)
        self.output_processor.abort(live)
        self._send_abort(live)

    def _check_alive(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        if not self.is_running:
            raise AsyncEngineDeadError("the engine loop is not running: call start() first")

    def _send_abort(self, request_ids: list[str]) -> None:
        # A gone engine has nothing left to abort (its reader reports why it went).
        if request_ids and self._dead_error is None:
            self._core.send(AbortRequests(request_ids))

    # --- event loop side: results from the engine core ---------------------------------------

    def _deliver(self, message: CoreMessage) -> None:
        """Called on the core's side (any thread): hand ``message`` to the event loop."""
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._handle, message)

    def _handle(self, message: CoreMessage) -> None:
        self._last_heard = time.monotonic()
        if isinstance(message, Heartbeat):
            return
        if isinstance(message, CoreOutputs):
            # Stats first, so that a client who sees its request finish then sees its blocks free.
            self.stats = message.stats
            outputs, stopped = self.output_processor.process_outputs(message.outputs)
            if stopped and self._dead_error is None:
                self._core.send(FinishSequences(stopped))
            self._dispatch(outputs)
        elif isinstance(message, AddResult):
            future = self._adds.get(message.op_id)
            if future is not None:
                _settle(future, message.error)
        else:
            self._set_dead(AsyncEngineDeadError(message.reason))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted by the caller meanwhile
            if output.failed:
                del self._streams[output.request_id]
                self.num_failed_requests += 1
                stream.put(RequestFailedError(output.error))
                continue
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]
                if self.on_request_finished is not None:
                    self.on_request_finished(output)

    def _set_dead(self, error: AsyncEngineDeadError) -> None:
        if self._dead_error is None:
            self._dead_error = error
        streams, self._streams = self._streams, {}
        self.output_processor.abort(list(streams))
        for stream in streams.values():
            stream.put(self._dead_error)
        for future in self._adds.values():
            _settle(future, self._dead_error)


class _ThreadCore:
    """The engine core on a thread of this process: the LLMEngine's core, stepped by its loop
    (requests arrive with their grammar compiled: the frontend compiled it in this process)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.config = engine.config
        # The event loop is the only one to use it from now on (the core has no text).
        self.tokenizer = engine.tokenizer
        self.num_gpu_blocks = engine.num_gpu_blocks
        self.initial_stats = engine.get_stats()
        self._core: EngineCoreLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self, deliver: Callable[[CoreMessage], None]) -> None:
        self._core = EngineCoreLoop(self.engine.engine_core, deliver)
        # A daemon, so that a step stuck in a kernel never keeps the process from exiting.
        self._thread = threading.Thread(target=self._core.run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    def send(self, op: CoreOp) -> None:
        assert self._core is not None
        self._core.ops.put(op)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self.send(None)
            self._thread.join(timeout)
        self.engine.shutdown()


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
