"""``distributed_executor_backend="mp"``: one spawned process per rank on this host.

Every rank is a worker process; the engine's process is none of them (as in vLLM v1's
MultiprocExecutor, unlike v0 where the driver was rank 0). The engine therefore never waits
inside a collective: it waits on its connections, where a dead or failed rank shows up at once,
so it can fail its requests and stop instead of hanging in an all-reduce whose peer is gone. It
also keeps the scheduler's and detokenizer's host time off rank 0's critical path. The price is
one more hop per step: rank 0's sampled tokens come back through a pipe (tens of microseconds).

The per-step message is pickled once and written to each rank's pipe (``rank_connections.py``);
ranks block in ``recv`` between steps, so an idle engine burns no CPU.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
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


class MultiprocExecutor(RemoteExecutor):
    def _init_workers(self) -> None:
        tp_size = self.config.parallel_config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        context = torch.multiprocessing.get_context("spawn")
        processes: list[BaseProcess] = []
        conns: list[Connection] = []
        for rank in range(tp_size):
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
    from pagedllm.executor.worker_loop import run_worker_loop

    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"
    )
    # Ctrl-C reaches the whole process group: only the engine handles it, then stops the ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if config.device_config.device.type == "cpu":
        # The ranks share the host's cores; each taking all of them would thrash.
        tp_size = config.parallel_config.tensor_parallel_size
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))
    ok = run_worker_loop(conn, config, rank, local_rank, init_method)
    conn.close()
    # Skip interpreter teardown after a failure: a peer may still hold this rank in a collective.
    os._exit(0 if ok else 1)


def _exit_with_parent(parent_pid: int) -> None:
    """A rank blocked in a collective never reads its pipe's end-of-file: leave when the engine's
    process is gone, whatever this process is doing."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)
