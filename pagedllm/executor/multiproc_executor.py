"""``distributed_executor_backend="mp"``: one process per rank on this host.

Every rank is a worker process; the engine's process is none of them (as in vLLM v1's
MultiprocExecutor, unlike v0 where the driver was rank 0). The engine therefore never waits
inside a collective: it waits on its connections, where a dead or failed rank shows up at once,
so it can fail its requests and stop instead of hanging in an all-reduce whose peer is gone. It
also keeps the scheduler's and detokenizer's host time off rank 0's critical path. The price is
one more hop per step: rank 0's sampled tokens come back through a pipe (tens of microseconds).

The per-step message is pickled once and written to each rank's pipe (``rank_connections.py``);
ranks block in ``recv`` between steps, so an idle engine burns no CPU.

The ranks are forked where that is safe, as vLLM does (``choose_start_method``): a user's script
that builds ``LLM(..., tensor_parallel_size=2)`` at top level, with no ``__main__`` guard, then
works, where spawned ranks would import the script again and start engines of their own.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch.multiprocessing

from pagedllm.config import EngineConfig
from pagedllm.executor.rank_connections import RankConnections, RemoteExecutor

logger = logging.getLogger(__name__)

# Seconds the workers get to leave on shutdown before they are terminated.
SHUTDOWN_GRACE_S = 5.0
# Names the ranks' start method ("fork", "spawn" or "forkserver"), as vLLM's
# VLLM_WORKER_MULTIPROC_METHOD does; unset, choose_start_method decides.
START_METHOD_ENV = "PAGEDLLM_WORKER_MULTIPROC_METHOD"
_START_METHODS = ("fork", "spawn", "forkserver")


class MultiprocExecutor(RemoteExecutor):
    def _init_workers(self) -> None:
        world_size = self.config.parallel_config.world_size
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        context = torch.multiprocessing.get_context(choose_start_method())
        processes: list[BaseProcess] = []
        conns: list[Connection] = []
        for rank in range(world_size):
            driver_end, worker_end = context.Pipe(duplex=True)
            process = context.Process(
                target=worker_process_main,
                args=(worker_end, self.config, rank, rank, init_method, os.getpid()),
                name=f"pagedllm-rank{rank}",
                daemon=True,
            )
            process.start()
            worker_end.close()
            processes.append(process)
            conns.append(driver_end)
        self.ranks = RankConnections(conns, processes=processes)
        self.worker_pids = [process.pid for process in processes]
        # Stops the workers however the executor ends: shutdown(), garbage collection, exit.
        self._finalizer = weakref.finalize(self, _stop_processes, self.ranks, processes)


def choose_start_method() -> str:
    """How to start the ranks: ``$PAGEDLLM_WORKER_MULTIPROC_METHOD`` if set, else "fork" where
    it is safe, else "spawn" with a one-line warning saying what a script then needs."""
    method = os.environ.get(START_METHOD_ENV)
    if method:
        if method not in _START_METHODS:
            raise ValueError(f"{START_METHOD_ENV}={method!r}: expected one of {', '.join(_START_METHODS)}")
        return method
    reason = _fork_unsafe_reason()
    if reason is None:
        return "fork"
    logger.warning(
        "spawning the ranks (%s, so fork is unsafe): build the engine under "
        '`if __name__ == "__main__":`, since each rank imports the main script again',
        reason,
    )
    return "spawn"


def _fork_unsafe_reason() -> str | None:
    """Why a forked rank could fail here, or None: a child forked after CUDA was initialised
    cannot use it (vLLM's rule); fork is Linux's only here (macOS's system libraries are not
    fork-safe). OpenMP's pool is handled in the rank (worker_process_main)."""
    if sys.platform != "linux":
        return f"this is {sys.platform}"
    if torch.cuda.is_initialized():
        return "CUDA is initialised in this process"
    return None


def _stop_processes(ranks: RankConnections, processes: list[BaseProcess]) -> None:
    if ranks.failure is None:
        ranks.send_shutdown()
    deadline = time.monotonic() + (SHUTDOWN_GRACE_S if ranks.failure is None else 0.0)
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(SHUTDOWN_GRACE_S)
    ranks.close()


def get_open_port() -> int:
    """A TCP port free on this host now, for the ranks' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_process_main(
    conn: Connection, config: EngineConfig, rank: int, local_rank: int, init_method: str, parent_pid: int
) -> None:
    """A rank's process: serve the engine until it says stop or disappears."""
    # force: a forked rank would otherwise keep the engine's handlers, without its rank.
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s", force=True
    )
    # Ctrl-C reaches the whole process group: only the engine handles it, then stops the ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked rank inherits the engine's handler (a server's shutdown): SIGTERM ends a rank.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    # The loop runs on a fresh thread. OpenMP's pool belongs to the thread that started it: in a
    # rank forked from an engine that had run torch ops, the main thread's pool lists workers the
    # fork did not copy, and its first parallel region would wait for them forever (GNU libgomp).
    results: list[bool] = []
    serve_args = (conn, config, rank, local_rank, init_method)
    loop = threading.Thread(target=lambda: results.append(_serve(*serve_args)))
    loop.start()
    loop.join()
    conn.close()
    # Skip interpreter teardown after a failure: a peer may still hold this rank in a collective.
    os._exit(0 if results == [True] else 1)


def _serve(conn: Connection, config: EngineConfig, rank: int, local_rank: int, init_method: str) -> bool:
    from pagedllm.executor.worker_loop import run_worker_loop

    if config.device_config.device.type == "cpu":
        # The ranks share the host's cores; each taking all of them would thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.parallel_config.world_size))
    return run_worker_loop(conn, config, rank, local_rank, init_method)


def _exit_with_parent(parent_pid: int) -> None:
    """A rank blocked in a collective never reads its pipe's end-of-file: leave when the engine's
    process is gone, whatever this process is doing."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)
