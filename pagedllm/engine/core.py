"""EngineCore: the loop that owns an LLMEngine and steps it, on a thread of the server's process or
in a process of its own (vLLM v1's EngineCore and EngineCoreProc).

```
frontend (asyncio, async_engine.py)             engine core (one thread owns the LLMEngine)
-----------------------------------             -------------------------------------------
AddRequest(op_id, request_id, ...)  ---------->  ops are applied between steps
AbortRequests(request_ids)          ---------->  engine.step(): schedule, execute, update,
                                                 detokenize and stop-check
                 <------------------  AddResult(op_id, error)
                 <------------------  CoreOutputs(outputs, stats, ...)   after every step (and ops)
                 <------------------  EngineDead(reason)                 then the loop ends
```

Ops and messages are plain data, so the same loop serves both transports: in a thread the
messages are handed over as they are; across processes they are pickled, with outputs sent as
deltas (``output_delta.py``). ``pagedllm serve`` runs the core in a process of its own: the HTTP
work (parsing, chat templates, tokenizing, a JSON chunk per token of every stream) then never
holds the GIL the scheduler needs, and a step is never delayed by it.

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
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import EngineStats, LLMEngine, freeze_startup_heap
from pagedllm.engine.output_delta import OutputDeltaEncoder
from pagedllm.logger import configure_logging
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Longest the idle loop sleeps before checking that its workers are alive.
HEALTH_CHECK_INTERVAL_S = 1.0
# How often a loop with requests waiting only for their grammar looks at the compilations.
COMPILE_POLL_S = 0.002


# --- frontend -> core -------------------------------------------------------------------------


@dataclass
class AddRequest:
    """``LLMEngine.add_request``'s arguments; answered by an AddResult with the same op_id."""

    op_id: int
    request_id: str
    prompt: str | None
    sampling_params: SamplingParams | None
    prompt_token_ids: list[int] | None
    arrival_time: float | None
    lora_request: LoRARequest | None = None


@dataclass
class AbortRequests:
    request_ids: list[str]


# None in the op queue stops the loop.
CoreOp = AddRequest | AbortRequests | None


# --- core -> frontend -------------------------------------------------------------------------


@dataclass
class AddResult:
    op_id: int
    # What add_request raised (ValueError: bad input), or None when the request was queued.
    error: Exception | None


@dataclass
class CoreOutputs:
    """A step's outputs (none after ops alone), and the engine's state after it.

    ``outputs`` holds RequestOutputs; across processes, their encoding (``output_delta.py``).
    ``aborted_request_ids``: requests aborted since the last message, which get no more outputs.
    """

    outputs: list[Any]
    stats: EngineStats
    num_aborted_requests: int
    num_failed_requests: int
    aborted_request_ids: list[str] = field(default_factory=list)


@dataclass
class Heartbeat:
    """Sent every HEALTH_CHECK_INTERVAL_S while idle, once the workers are found alive: with the
    outputs of every step, it tells the frontend that the engine is not stuck."""


@dataclass
class EngineDead:
    """The loop ended: the engine gave up (a worker gone, a device fault) or raised."""

    reason: str


@dataclass
class Ready:
    """The engine process's first message: what the frontend needs to validate requests."""

    config: EngineConfig
    tokenizer: Tokenizer | None
    stats: EngineStats


@dataclass
class StartupFailed:
    error: Exception


CoreMessage = AddResult | CoreOutputs | Heartbeat | EngineDead


class EngineCore:
    """Applies ops and steps ``engine`` until stopped; every result goes out through ``emit``.

    Only the thread in ``run`` touches the engine; ops arrive through ``ops`` from any thread.
    """

    def __init__(self, engine: LLMEngine, emit: Callable[[CoreMessage], None]) -> None:
        self.engine = engine
        self.ops: queue.SimpleQueue[CoreOp] = queue.SimpleQueue()
        self._emit = emit
        # Requests added and neither finished nor aborted.
        self._active: set[str] = set()
        # Adds waiting for their output constraint to compile (in the manager's threads, so that
        # no schema stalls the requests running), in arrival order.
        self._compiling: list[tuple[AddRequest, Future]] = []
        self._aborted: list[str] = []
        self._stopping = False
        self.num_aborted_requests = 0
        self.num_failed_requests = 0

    def run(self) -> None:
        try:
            while not self._stopping:
                busy = self.engine.has_unfinished_requests()
                self._apply_ops(busy)
                if not self._stopping and self.engine.has_unfinished_requests():
                    self._step()
        except Exception as e:
            logger.exception("the engine loop failed; no more requests are served")
            self._emit(EngineDead(f"the engine failed: {e!r}"))

    def _outputs_message(self, outputs: list[RequestOutput]) -> CoreOutputs:
        aborted, self._aborted = self._aborted, []
        return CoreOutputs(
            outputs, self.engine.get_stats(), self.num_aborted_requests, self.num_failed_requests, aborted
        )

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
                else:
                    self._abort(op.request_ids)
                op = self.ops.get_nowait()
        except queue.Empty:
            pass
        if not busy and not changed and not self._compiling:
            self.engine.check_health()  # raises ExecutorDeadError when a worker is gone
            self._emit(Heartbeat())
        changed |= self._add_compiled()
        if changed:
            # Aborts free blocks and adds queue requests: show it even when no step follows.
            self._emit(self._outputs_message([]))

    def _step(self) -> None:
        outputs = self.engine.step()
        for output in outputs:
            if output.finished:
                self._active.discard(output.request_id)
                if output.failed:
                    self.num_failed_requests += 1
        self._emit(self._outputs_message(outputs))

    def _add(self, op: AddRequest) -> None:
        structured = None if op.sampling_params is None else op.sampling_params.structured_outputs
        manager = self.engine.structured_output_manager
        if structured is not None and structured.compiled_grammar is None and manager is not None:
            self._compiling.append((op, manager.compile(structured)))
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
                op.sampling_params.structured_outputs.compiled_grammar = grammar.result()
            self.engine.add_request(
                op.request_id,
                op.prompt,
                op.sampling_params,
                op.prompt_token_ids,
                op.arrival_time,
                lora_request=op.lora_request,
            )
            self._active.add(op.request_id)
        except Exception as e:
            error = e
        self._emit(AddResult(op.op_id, error))

    def _abort(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        # An add still compiling is withdrawn: it must not start after its abort.
        withdrawn = [op for op, _ in self._compiling if op.request_id in ids]
        self._compiling = [entry for entry in self._compiling if entry[0].request_id not in ids]
        for op in withdrawn:
            self._emit(AddResult(op.op_id, RuntimeError(f"request {op.request_id} was aborted")))
        live = [request_id for request_id in request_ids if request_id in self._active]
        self.engine.abort_request(live)
        self._active.difference_update(live)
        self._aborted += live
        self.num_aborted_requests += len(live)


def run_engine_core_process(engine_args: EngineArgs, conn: Connection, log_level: int | None) -> None:
    """The engine process: build the engine and freeze its heap (``freeze_startup_heap``), send
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
        engine = LLMEngine.from_engine_args(engine_args)
    except Exception as e:
        if not isinstance(e, ValueError):  # bad arguments need no traceback; anything else does
            logger.exception("the engine failed to start")
        conn.send(StartupFailed(_picklable(e)))
        raise SystemExit(1) from e
    freeze_startup_heap()
    # Messages go out from a thread of their own: encoding and pickling a step's outputs then
    # overlap the engine thread's wait for the device's next step.
    outbox: queue.SimpleQueue[CoreMessage | None] = queue.SimpleQueue()
    core = EngineCore(engine, outbox.put)

    def send_messages() -> None:
        encoder = OutputDeltaEncoder()
        while (message := outbox.get()) is not None:
            if isinstance(message, CoreOutputs):
                message.outputs = encoder.encode(message.outputs, message.aborted_request_ids)
            elif isinstance(message, AddResult) and message.error is not None:
                message.error = _picklable(message.error)
            try:
                conn.send(message)
            except OSError:
                core.ops.put(None)  # the frontend is gone
                return

    def read_ops() -> None:
        while True:
            try:
                op = conn.recv()
            except (EOFError, OSError):
                op = None
            core.ops.put(op)
            if op is None:
                return

    conn.send(Ready(engine.config, engine.tokenizer, engine.get_stats()))
    sender = threading.Thread(target=send_messages, name="pagedllm-engine-outputs")
    sender.start()
    threading.Thread(target=read_ops, name="pagedllm-engine-ops", daemon=True).start()
    try:
        core.run()
    finally:
        outbox.put(None)
        sender.join()  # the last messages (EngineDead) go out before the process ends
        engine.shutdown()


def _picklable(error: Exception) -> Exception:
    """The error as the frontend can rebuild it: a ValueError stays one (bad input, a 400)."""
    if isinstance(error, ValueError):
        return ValueError(str(error))
    return RuntimeError(f"{type(error).__name__}: {error}")
