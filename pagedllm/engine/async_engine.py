"""AsyncLLMEngine: the synchronous LLMEngine stepped by a background thread, for asyncio servers.

```
event loop thread                                 engine thread
-----------------                                 -------------
add_request(id, ...)  --op: add_request--------->  apply ops   (add / abort, between steps only)
    awaits the op's future  <--result or error---  engine.step()
async for out in stream  <--outputs per step-----  snapshot stats, hand outputs to the loop
abort(id)             --op: abort_request------->  (next iteration: frees the request's blocks)
```

Every call into the LLMEngine happens on the engine thread, so nothing needs a lock: requests and
aborts are queued as operations that the thread applies before its next step, and results come
back to the event loop through ``loop.call_soon_threadsafe``. The model's kernels release the GIL,
so the event loop keeps serving HTTP while a step computes.

Failures: when a model step raises, the LLMEngine finds the request responsible and fails only
that one: its stream raises ``RequestFailedError`` with the step's error, and every other stream
goes on as if nothing happened. When the engine gives up (a worker gone, a device fault, steps
failing whatever runs in them: ``LLMEngine.step`` raises ExecutorDeadError) or anything else on
the engine thread raises, the engine is dead: ``is_healthy`` turns False, every stream and every
pending operation gets ``AsyncEngineDeadError``, and new requests are refused with it (the server
then exits non-zero, for its supervisor to restart it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import EngineStats, LLMEngine
from pagedllm.executor.abstract import ExecutorDeadError
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngineDeadError(RuntimeError):
    """The engine stopped serving: its thread failed, or it was shut down."""


class RequestFailedError(RuntimeError):
    """The engine failed this request: a model step raised whenever it ran (even alone)."""


class RequestStream:
    """The outputs of one request, in order, as an async iterator.

    Outputs are cumulative (text, token ids and logprobs so far), so when the consumer falls
    behind the engine only the newest output matters: each iteration returns the latest one
    queued. Iteration ends after the finished output, after an error (raised), or when the
    request is aborted.
    """

    _END = object()

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
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
        while isinstance(item, RequestOutput) and self._items and isinstance(self._items[0], RequestOutput):
            item = self._items.popleft()
        if item is self._END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncLLMEngine:
    """An LLMEngine served to asyncio code; see the module docstring.

    Args:
        engine: the engine to run. From now on only this object's thread may call it.
        on_request_finished: called on the event loop with each request's finished output
            (metrics hook).
    """

    def __init__(
        self, engine: LLMEngine, on_request_finished: Callable[[RequestOutput], None] | None = None
    ) -> None:
        self.engine = engine
        self.on_request_finished = on_request_finished
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Operations for the engine thread; None wakes it to stop.
        self._ops: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        # Event loop side: the stream of each request not finished yet.
        self._streams: dict[str, RequestStream] = {}
        # Engine thread side: requests added and neither finished nor aborted.
        self._active: set[str] = set()
        # Futures of queued ops, so that a dying engine fails them rather than leaving them hanging.
        self._pending: set[asyncio.Future[None]] = set()
        self._dead_error: AsyncEngineDeadError | None = None
        self._stopping = False
        # Written by the engine thread only; a reference swap is atomic, so readers need no lock.
        self.stats: EngineStats = engine.get_stats()
        self.num_aborted_requests = 0
        self.num_failed_requests = 0

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(engine_args), **kwargs)

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread, delivering results to the running event loop."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already running")
        self._loop = asyncio.get_running_loop()
        # A daemon, so that a step stuck in a kernel never keeps the process from exiting.
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step; unfinished streams get an error."""
        if self._thread is None:
            return
        self._stopping = True
        self._ops.put(None)
        await asyncio.to_thread(self._thread.join, timeout)
        self._set_dead(AsyncEngineDeadError("the engine was shut down"))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_healthy(self) -> bool:
        if not self.is_running or self._dead_error is not None:
            return False
        try:
            self.engine.check_health()
        except ExecutorDeadError:
            return False
        return True

    def dead_reason(self) -> str:
        """Why the engine stopped serving ("" while it is healthy)."""
        if self._dead_error is not None:
            return str(self._dead_error)
        try:
            self.engine.check_health()
        except ExecutorDeadError as e:
            return str(e)
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
    ) -> RequestStream:
        """Queue a request; returns its output stream once the engine has taken it.

        Raises what ``LLMEngine.add_request`` raises (ValueError for bad input), before any output,
        or AsyncEngineDeadError.
        """
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        kwargs = {
            "prompt": prompt,
            "sampling_params": sampling_params,
            "prompt_token_ids": prompt_token_ids,
            "arrival_time": arrival_time,
        }
        try:
            await self._call(lambda: self._add_on_engine_thread(request_id, kwargs))
        except asyncio.CancelledError:
            # The caller left while the op was queued: the request may have been added since.
            self.abort(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """add_request, then yield its outputs; leaving the loop early aborts the request."""
        stream = await self.add_request(request_id, prompt, sampling_params, prompt_token_ids, arrival_time)
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
        if live and self._dead_error is None:
            self._ops.put(lambda: self._abort_on_engine_thread(live))

    def fail_all_requests(self, message: str) -> None:
        """End every open stream with an error saying ``message`` (the server is going away), and
        abort the requests."""
        error = AsyncEngineDeadError(message)
        live = list(self._streams)
        for request_id in live:
            self._streams.pop(request_id).put(error)
        if live and self._dead_error is None:
            self._ops.put(lambda: self._abort_on_engine_thread(live))

    def _check_alive(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        if not self.is_running:
            raise AsyncEngineDeadError("the engine loop is not running: call start() first")

    async def _call(self, fn: Callable[[], None]) -> None:
        """Run fn on the engine thread before its next step; raise what it raises."""
        future = asyncio.get_running_loop().create_future()
        self._pending.add(future)

        def op() -> None:
            try:
                fn()
            except Exception as e:
                self._call_in_loop(_settle, future, e)
            else:
                self._call_in_loop(_settle, future, None)

        self._ops.put(op)
        try:
            await future
        finally:
            self._pending.discard(future)

    # --- event loop side: results from the engine thread -------------------------------------

    def _call_in_loop(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted by the caller meanwhile
            if output.failed:
                del self._streams[output.request_id]
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
        for stream in streams.values():
            stream.put(self._dead_error)
        for future in self._pending:
            _settle(future, self._dead_error)

    # --- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_ops(block=not self.engine.has_unfinished_requests())
                if not self._stopping and self.engine.has_unfinished_requests():
                    self._step()
        except Exception as e:
            logger.exception("the engine loop failed; no more requests are served")
            dead = AsyncEngineDeadError(f"the engine failed: {e!r}")
            dead.__cause__ = e
            self._call_in_loop(self._set_dead, dead)

    def _apply_ops(self, block: bool) -> None:
        """Apply every queued op; when idle, first wait for one."""
        try:
            op = self._ops.get(block=block)
        except queue.Empty:
            return
        while op is not None:
            op()
            try:
                op = self._ops.get_nowait()
            except queue.Empty:
                break
        # Aborts free blocks: show it even while no step follows.
        self.stats = self.engine.get_stats()

    def _step(self) -> None:
        outputs = self.engine.step()
        for output in outputs:
            if output.finished:
                self._active.discard(output.request_id)
                if output.failed:
                    self.num_failed_requests += 1
        # Stats first, so that a client who sees its request finish then sees its blocks free.
        self.stats = self.engine.get_stats()
        self._call_in_loop(self._dispatch, outputs)

    def _add_on_engine_thread(self, request_id: str, kwargs: dict[str, Any]) -> None:
        self.engine.add_request(request_id, **kwargs)
        self._active.add(request_id)

    def _abort_on_engine_thread(self, request_ids: list[str]) -> None:
        live = [request_id for request_id in request_ids if request_id in self._active]
        self.engine.abort_request(live)
        self._active.difference_update(live)
        self.num_aborted_requests += len(live)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
