"""The engine core in processes of its own, started before the engine is imported.

``pagedllm serve`` starts the engine's process first thing (``start_engine_core``), then imports
the server (FastAPI, and the engine's frontend: torch, transformers), which takes seconds: the
engine process imports and loads its model meanwhile, rather than after. So this module imports
neither torch nor the engine: the process imports its loop (core_proc.py) itself.

``AsyncLLMEngine.from_started_core`` serves the core once it is ready;
``AsyncLLMEngine.in_engine_process`` does both at once.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_messages import CoreMessage, CoreOp, EngineDead, Ready, StartupFailed
from pagedllm.engine.dp_client import DataParallelCore, environment, start_replicas, wait_for_replicas
from pagedllm.logger import configured_level

logger = logging.getLogger(__name__)

# How long shutdown waits for the engine process to exit before it is killed.
PROCESS_EXIT_TIMEOUT_S = 10.0


class StartedEngineCore:
    """The engine core's processes (one, or one per data-parallel replica), started and loading
    their model while the caller goes on; ``wait`` returns them as one core once they are ready.

    Raises ValueError for data-parallel sizes this host cannot run, before starting any.
    """

    def __init__(self, engine_args: EngineArgs) -> None:
        self.start_time = time.perf_counter()
        self._data_parallel = engine_args.data_parallel_size != 1
        if self._data_parallel:
            self._cores = start_replicas(engine_args, ProcessCore)
        else:
            self._cores = [ProcessCore(engine_args)]

    def wait(self) -> ProcessCore | DataParallelCore:
        """The core, once its model is loaded; raises what building it raised there (ValueError
        for bad arguments)."""
        if self._data_parallel:
            return wait_for_replicas(self._cores)
        self._cores[0].wait_ready()
        return self._cores[0]

    def close(self) -> None:
        """Stop the processes (those a core already serves too); idempotent."""
        for core in self._cores:
            core.close(PROCESS_EXIT_TIMEOUT_S)


def start_engine_core(engine_args: EngineArgs) -> StartedEngineCore:
    """Start the engine core's processes; see StartedEngineCore. The processes are spawned, so a
    script that calls this needs the ``if __name__ == "__main__":`` guard that any spawning
    program does."""
    return StartedEngineCore(engine_args)


def _run_engine_core_process(engine_args: EngineArgs, conn: Connection, log_level: int | None) -> None:
    # Imported here, in the engine's process: the frontend starts it before importing the engine.
    from pagedllm.engine.core_proc import run_engine_core_process

    run_engine_core_process(engine_args, conn, log_level)


class ProcessCore:
    """The engine core in a process of its own, reached through a pipe.

    The process is spawned, not forked: a fork inherits whatever threads this process started
    (OpenMP's, a tokenizer's) in whatever state they were, and CUDA cannot run in a child forked
    after its parent used it. It is not a daemon: with tensor parallelism it starts the ranks'
    processes itself, which a daemon may not.
    """

    def __init__(
        self, engine_args: EngineArgs, env: dict[str, str] | None = None, name: str = "pagedllm-engine"
    ) -> None:
        """Start the process (``env``: variables it starts with, e.g. CUDA_VISIBLE_DEVICES);
        ``wait_ready`` waits for its model to load."""
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=_run_engine_core_process,
            args=(engine_args, child_conn, configured_level()),
            name=name,
        )
        with environment(env or {}):  # a spawned child starts with the parent's environment
            self.process.start()
        child_conn.close()
        # Ops go down the pipe from a thread of their own: a stopped engine fills the pipe, and a
        # send on the event loop would then freeze every stream and /health with it.
        self._outbox: queue.SimpleQueue[CoreOp] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._closing = False
        self._reader: threading.Thread | None = None

    def wait_ready(self) -> None:
        """Wait for the engine's Ready; raise what building it raised there."""
        try:
            message = self._conn.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(
                f"the engine process exited with code {self.process.exitcode} while starting"
            ) from None
        if isinstance(message, StartupFailed):
            self.process.join()
            raise message.error
        assert isinstance(message, Ready)
        self.config = message.config
        self.tokenizer = message.tokenizer
        self.num_gpu_blocks = message.num_gpu_blocks
        self.initial_stats = message.stats

    def start(self, deliver: Callable[[CoreMessage], None]) -> None:
        self._reader = threading.Thread(
            target=self._read, args=(deliver,), name="pagedllm-engine-outputs", daemon=True
        )
        self._reader.start()
        self._sender = threading.Thread(target=self._send_ops, name="pagedllm-engine-ops", daemon=True)
        self._sender.start()

    def send(self, op: CoreOp) -> None:
        """Queue ``op`` for the engine; never blocks. A gone engine's reader reports the death."""
        self._outbox.put(op)

    def _send_ops(self) -> None:
        while True:
            op = self._outbox.get()
            try:
                self._conn.send(op)
            except OSError:
                return  # the engine process is gone; the reader reports it
            if op is None:
                return

    def is_alive(self) -> bool:
        return self.process.is_alive() and self._reader is not None and self._reader.is_alive()

    def close(self, timeout: float) -> None:
        if self._closing:
            return
        self._closing = True
        if self.process.is_alive():
            if self._sender is None:  # never started: no thread to hand the stop to
                with contextlib.suppress(OSError):
                    self._conn.send(None)
            else:
                self.send(None)
            self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("the engine process did not stop in %g s: killing it", timeout)
            self.process.kill()
            self.process.join()
        self._conn.close()

    def _read(self, deliver: Callable[[CoreMessage], None]) -> None:
        """Receive the engine's messages (unpickling them off the event loop), deliver them."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if not self._closing:
                    self.process.join(PROCESS_EXIT_TIMEOUT_S)
                    deliver(EngineDead(f"the engine process died (exit code {self.process.exitcode})"))
                return
            deliver(message)
            if isinstance(message, EngineDead):
                return
