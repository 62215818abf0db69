"""The driver's side of the worker loop: one connection per rank, a broadcast, a guarded wait.

Waiting is where a distributed engine hangs, so every wait here watches, besides the answers it
expects, every rank's connection (an unexpected frame is a failure report; end-of-file is a
process that died, even by SIGKILL, since the kernel closes its sockets) and the executor's
liveness probes (process sentinels for "mp", actor tasks for "ray"). A failure, a death or a
timeout raises ExecutorDeadError within a second, naming the rank.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import Executor, ExecutorDeadError, WorkerCall
from pagedllm.executor.worker_loop import SHUTDOWN_FRAME, encode_call
from pagedllm.step_io import ModelRunnerOutput, SchedulerOutput

# Seconds between liveness checks while a wait has nothing to read.
POLL_INTERVAL_S = 0.5
# Seconds a step may take before the engine gives up on its workers (a hung collective).
EXECUTE_MODEL_TIMEOUT_S = float(os.environ.get("PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S", "300"))


class RankConnections:
    """Args:
    conns: rank r's connection at index r.
    processes: rank r's process at index r ("mp"), whose sentinels show a death at once; or None.
    find_dead_rank: a further probe run every POLL_INTERVAL_S: a description of a rank that is
        gone, or None while all are alive.
    """

    def __init__(
        self,
        conns: list[Connection],
        processes: list[BaseProcess] | None = None,
        find_dead_rank: Callable[[], str | None] | None = None,
    ) -> None:
        self.conns = conns
        self.processes = processes or []
        self.find_dead_rank = find_dead_rank or (lambda: None)
        # Why the ranks can no longer be used; set once, by the first failure seen.
        self.failure: str | None = None

    def call(
        self,
        method: WorkerCall,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        reply_rank: int | None,
        timeout: float | None,
    ) -> list[Any]:
        """Broadcast the call; returns the answers of every rank (reply_rank None) or of
        reply_rank alone. A failure on any rank raises (ExecutorDeadError, from the rank's error)."""
        self.send(method, args, kwargs, reply_rank)
        ranks = range(len(self.conns)) if reply_rank is None else [reply_rank]
        return self._receive(list(ranks), _method_name(method), timeout)

    def send(
        self, method: WorkerCall, args: tuple[Any, ...], kwargs: dict[str, Any] | None, reply_rank: int | None
    ) -> None:
        """Broadcast a call without waiting for its answers (``receive`` them, in call order)."""
        self.send_frame(encode_call(method, args, kwargs, reply_rank))

    def send_frame(self, frame: bytes) -> None:
        """Broadcast an encoded call (``encode_call``)."""
        self.check()
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(frame)
            except OSError as e:
                self._raise_sent_error()
                self._fail(f"rank {rank} is gone (its connection broke: {e!r}){self._exit_detail(rank)}")

    def receive(self, rank: int, what: str, timeout: float | None) -> Any:
        """The answer of ``rank`` to the oldest call sent to it and not yet received."""
        return self._receive([rank], what, timeout)[0]

    def check(self) -> None:
        if self.failure is None:
            dead = self.find_dead_rank() or self._ended_process()
            if dead is not None:
                self._raise_sent_error()
                self.failure = dead
        if self.failure is not None:
            raise ExecutorDeadError(f"the workers cannot run: {self.failure}")

    def send_shutdown(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # already gone
                conn.send_bytes(SHUTDOWN_FRAME)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()

    def _receive(self, ranks: list[int], what: str, timeout: float | None) -> list[Any]:
        answers: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        rank_of = {id(conn): rank for rank, conn in enumerate(self.conns)}
        while len(answers) < len(ranks):
            # A rank that answered is not read again: its next frame answers the next call.
            ready = wait(
                [conn for rank, conn in enumerate(self.conns) if rank not in answers], POLL_INTERVAL_S
            )
            for conn in ready:
                rank = rank_of[id(conn)]
                answers[rank] = self._read(conn, rank, what, expected=rank in ranks)
            if not ready:
                self.check()
            if deadline is not None and time.monotonic() > deadline:
                self._fail(
                    f"no answer to {what} from rank(s) {sorted(set(ranks) - set(answers))} in {timeout} s"
                )
        return [answers[rank] for rank in ranks]

    def _read(self, conn: Connection, rank: int, what: str, expected: bool) -> Any:
        try:
            ok, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            self._fail(f"rank {rank} died during {what}{self._exit_detail(rank)}")
        if not ok:
            self._raise_rank_error(rank, what, payload)
        if not expected:
            self._fail(f"rank {rank} answered {what}, which it was not asked to answer")
        return payload

    def _raise_rank_error(self, rank: int, what: str, payload: tuple[BaseException, str]) -> NoReturn:
        error, text = payload
        self.failure = f"rank {rank} failed in {what}: {error!r}"
        raise ExecutorDeadError(f"the workers cannot run: {self.failure}\n--- rank {rank}: {text}") from error

    def _raise_sent_error(self) -> None:
        """Raise the error a rank sent before it ended (a worker that could not be built sends
        its error, then exits), if one waits unread; the answers before it are moot now."""
        for rank, conn in enumerate(self.conns):
            with contextlib.suppress(EOFError, OSError):
                while conn.poll(0):
                    ok, payload = pickle.loads(conn.recv_bytes())
                    if not ok:
                        self._raise_rank_error(rank, "its last call", payload)

    def _ended_process(self) -> str | None:
        for rank, process in enumerate(self.processes):
            if process.exitcode is not None:
                return f"rank {rank} (pid {process.pid}) died{self._exit_detail(rank)}"
        return None

    def _exit_detail(self, rank: int) -> str:
        if rank >= len(self.processes):
            return ""
        process = self.processes[rank]
        # The kernel closes a killed process's pipe a moment before its parent can reap it.
        process.join(1.0)
        return "" if process.exitcode is None else f" (exit code {process.exitcode})"

    def _fail(self, why: str) -> None:
        self.failure = self.failure or why
        raise ExecutorDeadError(f"the workers cannot run: {why}")


class RemoteExecutor(Executor):
    """An executor whose ranks live in other processes, reached through ``self.ranks``.

    ``_init_workers`` sets ``self.ranks``, ``self.worker_pids`` and ``self._finalizer`` (a
    ``weakref.finalize`` that stops the workers, so they stop however the executor ends). Any
    failure stops every rank before it is raised: after one, the ranks are out of step or gone.
    """

    ranks: RankConnections
    worker_pids: list[int]
    _finalizer: Callable[[], Any]

    def __init__(self, config: EngineConfig) -> None:
        # Steps sent whose answers have not been read yet, oldest first (the output rank answers
        # in order).
        self._pending: collections.deque[PendingStep] = collections.deque()
        # The rank whose samples the engine reads: rank 0, or the last pipeline stage's first.
        self.output_rank = config.parallel_config.output_rank
        super().__init__(config)

    def collective_rpc(
        self, method: WorkerCall, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        try:
            # A step's answer still unread (one that only told the ranks which requests finished
            # is never waited for) comes first on the output rank's connection: read it off before the call.
            self._read_pending()
            return self.ranks.call(method, args, kwargs, None, None)
        except BaseException:
            self.shutdown()
            raise

    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Send the step to every rank and return; ``get()`` on the result gives the output rank's
        samples.

        The engine schedules step N + 1 while step N runs on the ranks, and sends it before it
        reads step N's answer: the ranks find it waiting when they finish N, and the driver's
        round trip (reading the answer, applying it, scheduling) stays off their critical path;
        with pipeline stages, the first stage runs step N + 1 while the last runs N. A message
        larger than a socket's buffer (a batch of prompts) blocks this write until the rank has
        read it, that is until the rank finishes the step it runs: a rank's loop only executes
        and reads, its answers go out from a thread of their own (worker_loop.ReplySender), so
        the two ends never wait on each other.
        """
        try:
            frame = encode_call("execute_model_remote", (scheduler_output,), None, self.output_rank)
            while len(self._pending) > 1:
                # One answer outstanding is all the overlap needs; unread answers piling up (steps
                # nobody waits for) could fill the sockets.
                self._pending.popleft().receive()
            self.ranks.send_frame(frame)
        except BaseException:
            self.shutdown()
            raise
        step = PendingStep(self)
        self._pending.append(step)
        return step

    def _read_pending(self, until: PendingStep | None = None) -> None:
        """Read the answers of the steps sent, oldest first, up to ``until`` (all when None)."""
        pending = self._pending
        while pending:
            step = pending.popleft()
            step.receive()
            if step is until:
                return

    def check_health(self) -> None:
        self.ranks.check()

    def shutdown(self) -> None:
        self._finalizer()


class PendingStep:
    """A step sent to the ranks (a ``StepHandle``); its samples are read once, by ``get()`` or by
    a later call that must read past them (answers come in the order the steps were sent)."""

    def __init__(self, executor: RemoteExecutor) -> None:
        self._executor = executor
        self._result: ModelRunnerOutput | None = None
        self._received = False

    def receive(self) -> None:
        """Read this step's answer, the oldest unread on the output rank's connection."""
        if self._received:
            return
        self._received = True
        try:
            self._executor.ranks.check()
            executor = self._executor
            timeout = EXECUTE_MODEL_TIMEOUT_S
            self._result = executor.ranks.receive(executor.output_rank, "execute_model", timeout)
        except BaseException:
            self._executor.shutdown()
            raise

    def get(self) -> ModelRunnerOutput:
        if not self._received:
            self._executor._read_pending(until=self)
        assert self._result is not None
        return self._result


def _method_name(method: WorkerCall) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", repr(method))
