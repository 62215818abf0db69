"""The loop that owns an EngineCore and steps it, on a thread of the server's process or in a
process of its own (vLLM v1's EngineCoreProc).

```
frontend (asyncio, async_engine.py)             engine core loop (one thread owns the EngineCore)
-----------------------------------             -------------------------------------------------
AddRequest(op_id, EngineCoreRequest) -------->  ops are applied between steps
AbortRequests(request_ids)           -------->  core.step(): schedule, execute, sample
FinishSequences(stopped)             -------->  (sequences a stop string ended, in the frontend)
                 <------------------  AddResult(op_id, error)
                 <------------------  CoreOutputs(EngineCoreOutputs, stats)  after every step
                 <------------------  Heartbeat                              every second, idle
                 <------------------  EngineDead(reason)                     then the loop ends
```

Ops and messages (core_messages.py) are plain data, so the same loop serves both transports: in
a thread the messages are handed over as they are; across processes they are pickled. What
crosses is token ids (``EngineCoreOutputs``: each sequence's new tokens), never text: the
frontend detokenizes.
``pagedllm serve`` runs the core in a process of its own: the HTTP work (parsing, chat
templates, tokenizing, a JSON chunk per token of every stream) then never holds the GIL the
scheduler needs, and a step is never delayed by it.

While idle the loop wakes every HEALTH_CHECK_INTERVAL_S to check the workers, so a rank that
dies between requests is reported (``EngineDead``) without waiting for the next step.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core import EngineCore
from pagedllm.engine.core_messages import (
    AbortRequests,
    AddRequest,
    AddResult,
    CoreMessage,
    CoreOp,
    CoreOutputs,
    EngineDead,
    Heartbeat,
    Ready,
    StartupFailed,
)
from pagedllm.engine.heap import HeapTrimmer
from pagedllm.engine.llm_engine import freeze_startup_heap
from pagedllm.logger import configure_logging
from pagedllm.step_io import EngineCoreOutputs
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

# Longest the idle loop sleeps before checking that its workers are alive.
HEALTH_CHECK_INTERVAL_S = 1.0
# How often a loop with requests waiting only for their grammar looks at the compilations.
COMPILE_POLL_S = 0.002


class EngineCoreLoop:
    """Applies ops and steps ``core`` until stopped; every result goes out through ``emit``.

    Only the thread in ``run`` touches the core; ops arrive through ``ops`` from any thread.
    ``structured_output_manager`` compiles the constraints of requests that arrive without their
    compiled grammar (a compiled grammar does not cross processes), in its threads, so that no
    schema stalls the requests running; None where requests arrive compiled, or where rank 0 runs
    in a process of its own (which compiles them itself).
    """

    def __init__(
        self,
        core: EngineCore,
        emit: Callable[[CoreMessage], None],
        structured_output_manager: StructuredOutputManager | None = None,
    ) -> None:
        self.core = core
        self.ops: queue.SimpleQueue[CoreOp] = queue.SimpleQueue()
        self._emit = emit
        self._manager = structured_output_manager
        # Adds waiting for their constraint to compile, in arrival order.
        self._compiling: list[tuple[AddRequest, Future]] = []
        self._stopping = False

    def run(self) -> None:
        trimmer = HeapTrimmer()
        was_busy = False
        try:
            while not self._stopping:
                busy = self.core.has_unfinished_requests()
                if was_busy and not busy:
                    trimmer.maybe_trim()  # the work just ended: hand back what it freed
                was_busy = busy
                self._apply_ops(busy)
                if not self._stopping and self.core.has_unfinished_requests():
                    self._emit(CoreOutputs(self.core.step(), self.core.get_stats()))
        except Exception as e:
            logger.exception("the engine loop failed; no more requests are served")
            self._emit(EngineDead(f"the engine failed: {e!r}"))

    def _apply_ops(self, busy: bool) -> None:
        """Apply every queued op and every add whose grammar compiled. Idle, first wait for an op
        (checking the workers now and then); busy, never wait."""
        changed = False
        try:
            if busy:
                op = self.ops.get_nowait()
            else:
                op = self.ops.get(timeout=COMPILE_POLL_S if self._compiling else HEALTH_CHECK_INTERVAL_S)
            while True:
                changed = True
                if op is None:
                    self._stopping = True
                    return
                if isinstance(op, AddRequest):
                    self._add(op)
                elif isinstance(op, AbortRequests):
                    self._abort(op.request_ids)
                else:
                    self.core.finish_sequences(op.stopped)
                op = self.ops.get_nowait()
        except queue.Empty:
            pass
        if not busy and not changed and not self._compiling:
            self.core.check_health()  # raises ExecutorDeadError when a worker is gone
            self._emit(Heartbeat())
        changed |= self._add_compiled()
        if changed:
            # Aborts free blocks and adds queue requests: show it even when no step follows.
            self._emit(CoreOutputs(EngineCoreOutputs(), self.core.get_stats()))

    def _add(self, op: AddRequest) -> None:
        structured = op.request.sampling_params.structured_outputs
        if structured is not None and structured.compiled_grammar is None and self._manager is not None:
            self._compiling.append((op, self._manager.compile(structured)))
        else:
            self._add_now(op, None)

    def _add_compiled(self) -> bool:
        done = [(op, future) for op, future in self._compiling if future.done()]
        if done:
            self._compiling = [entry for entry in self._compiling if not entry[1].done()]
        for op, future in done:
            self._add_now(op, future)
        return bool(done)

    def _add_now(self, op: AddRequest, grammar: Future | None) -> None:
        error = None
        try:
            if grammar is not None:
                op.request.sampling_params.structured_outputs.compiled_grammar = grammar.result()
            self.core.add_request(op.request)
        except Exception as e:
            error = e
        self._emit(AddResult(op.op_id, error))

    def _abort(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        # An add still compiling is withdrawn: it must not start after its abort.
        withdrawn = [op for op, _ in self._compiling if op.request.request_id in ids]
        self._compiling = [entry for entry in self._compiling if entry[0].request.request_id not in ids]
        for op in withdrawn:
            self._emit(AddResult(op.op_id, RuntimeError(f"request {op.request.request_id} was aborted")))
        self.core.abort_requests(request_ids)


def run_engine_core_process(engine_args: EngineArgs, conn: Connection, log_level: int | None) -> None:
    """The engine process: build the core and freeze its heap (``freeze_startup_heap``), send
    Ready (or StartupFailed), then apply the ops that arrive on ``conn`` until told to stop or
    until the frontend is gone (end of the pipe).

    ``log_level``: the frontend's pagedllm log level, when it configured one.
    """
    if log_level is not None:
        configure_logging(log_level)
    # Ctrl-C in a terminal reaches the whole process group: the frontend stops this process
    # itself, after ending its streams.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        config = engine_args.create_engine_config()
        tokenizer = get_tokenizer(config.model_config)
        core = EngineCore(config)
    except Exception as e:
        if not isinstance(e, ValueError):  # bad arguments need no traceback; anything else does
            logger.exception("the engine failed to start")
        conn.send(StartupFailed(_picklable(e)))
        raise SystemExit(1) from e
    freeze_startup_heap()
    # Messages go out from a thread of their own: pickling a step's outputs then overlaps the
    # engine thread's wait for the device's next step.
    outbox: queue.SimpleQueue[CoreMessage | None] = queue.SimpleQueue()
    # The frontend compiled each constraint to validate it, but a native matcher does not cross
    # the pipe: it is compiled again here when rank 0 runs here, else by rank 0 itself.
    manager = None
    if core.executor.rank_zero_in_process:
        manager = StructuredOutputManager.for_model(config.model_config, tokenizer)
    loop = EngineCoreLoop(core, outbox.put, manager)

    def send_messages() -> None:
        while (message := outbox.get()) is not None:
            if isinstance(message, AddResult) and message.error is not None:
                message.error = _picklable(message.error)
            try:
                conn.send(message)
            except OSError:
                loop.ops.put(None)  # the frontend is gone
                return

    def read_ops() -> None:
        while True:
            try:
                op = conn.recv()
            except (EOFError, OSError):
                op = None
            loop.ops.put(op)
            if op is None:
                return

    conn.send(Ready(config, tokenizer, core.get_stats(), core.num_gpu_blocks))
    sender = threading.Thread(target=send_messages, name="pagedllm-engine-outputs")
    sender.start()
    threading.Thread(target=read_ops, name="pagedllm-engine-ops", daemon=True).start()
    try:
        loop.run()
    finally:
        outbox.put(None)
        sender.join()  # the last messages (EngineDead) go out before the process ends
        core.shutdown()


def _picklable(error: Exception) -> Exception:
    """The error as the frontend can rebuild it: a ValueError stays one (bad input, a 400)."""
    if isinstance(error, ValueError):
        return ValueError(str(error))
    return RuntimeError(f"{type(error).__name__}: {error}")
