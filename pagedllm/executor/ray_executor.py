"""``distributed_executor_backend="ray"``: one Ray actor per rank, over the nodes of a Ray cluster.

Ray places the ranks and keeps their processes; it is not on the per-step path. A placement group
reserves one device per rank (a GPU, or a CPU for CPU ranks), packed onto as few nodes as hold
them; the ranks are numbered with the driver's node first, so rank 0 (whose answer the engine
waits for) is local when it can be. Each actor then opens a TCP listener; the engine connects to
every one (authenticated with a fresh key, since frames are pickles) and from there on talks to
the ranks exactly as the "mp" executor talks to its processes (``rank_connections.py``).

The cluster: the one ``ray.init()`` finds (the ``RAY_ADDRESS`` environment variable, or a
``ray start`` cluster on this host), else a new local one; or call ``ray.init(address=...)``
before building the engine. Ray is an optional dependency: ``pip install pagedllm[ray]``.
"""

from __future__ import annotations

import logging
import os
import socket
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.executor.rank_connections import RankConnections, RemoteExecutor
from pagedllm.parallel_config import ParallelConfig

logger = logging.getLogger(__name__)

# Seconds to wait for the cluster to reserve the ranks' devices.
PLACEMENT_TIMEOUT_S = 120.0
# Seconds the ranks get to leave on shutdown before their actors are killed.
SHUTDOWN_GRACE_S = 5.0


class RayWorkerActor:
    """One rank's process in the cluster (made a Ray actor by ``ray.remote`` at run time)."""

    def describe(self) -> tuple[str, str, list[str], int]:
        """(node id, node IP, GPU ids Ray gave this actor, pid)."""
        import ray

        context = ray.get_runtime_context()
        gpu_ids = [str(gpu) for gpu in context.get_accelerator_ids().get("GPU", [])]
        return context.get_node_id(), ray.util.get_node_ip_address(), gpu_ids, os.getpid()

    def open_port(self) -> int:
        """A TCP port free on this node now (rank 0's: the process group's rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def listen(self, authkey: bytes) -> tuple[str, int]:
        """Open the engine's channel to this rank; returns its address."""
        import ray

        self.listener = Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
        return self.listener.address

    def run(
        self,
        config: EngineConfig,
        rank: int,
        local_rank: int,
        distributed_init_method: str,
        cuda_visible_devices: str | None,
    ) -> bool:
        """Accept the engine's connection and serve it until told to stop (worker_loop.py)."""
        from pagedllm.executor.worker_loop import run_worker_loop

        if cuda_visible_devices is not None:
            # Every GPU of the node the ranks use, so that cuda:local_rank is this rank's and NCCL
            # sees its peers' devices (CUDA reads this on first use, which is still to come).
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        conn = self.listener.accept()
        self.listener.close()
        _no_delay(conn)
        return run_worker_loop(conn, config, rank, local_rank, distributed_init_method)


@dataclass
class _RayRanks:
    """What the executor holds in the cluster, for its finalizer to release."""

    placement_group: Any
    actors: list[Any] = field(default_factory=list)
    # Each rank's run() task, which ends when its actor dies or leaves.
    loops: list[Any] = field(default_factory=list)
    ranks: RankConnections | None = None


class RayExecutor(RemoteExecutor):
    def _init_workers(self) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group

        if not ray.is_initialized():
            ray.init()
        world_size = self.config.parallel_config.world_size
        use_gpus = self.config.device_config.device.type == "cuda"
        device = "GPU" if use_gpus else "CPU"
        _check_cluster_size(ray, self.config.parallel_config, device)
        held = _RayRanks(placement_group([{device: 1}] * world_size, strategy="PACK"))
        self._finalizer = weakref.finalize(self, _release, ray, held)
        try:
            self._place_actors(ray, held, use_gpus)
            self._start_ranks(ray, held, use_gpus)
        except BaseException:
            self.shutdown()
            raise
        self.ranks = held.ranks

    def _place_actors(self, ray: Any, held: _RayRanks, use_gpus: bool) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        parallel_config = self.config.parallel_config
        world_size = parallel_config.world_size
        try:
            ray.get(held.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as e:
            raise ValueError(
                f"the Ray cluster could not reserve {world_size} {'GPUs' if use_gpus else 'CPUs'} for "
                f"{_sizes(parallel_config)} in {PLACEMENT_TIMEOUT_S:.0f} s (are they in use?)"
            ) from e
        actor_class = ray.remote(RayWorkerActor)
        for bundle in range(world_size):
            strategy = PlacementGroupSchedulingStrategy(
                held.placement_group, placement_group_bundle_index=bundle
            )
            options = {"num_cpus": 0, "num_gpus": 1} if use_gpus else {"num_cpus": 1, "num_gpus": 0}
            held.actors.append(actor_class.options(scheduling_strategy=strategy, **options).remote())

    def _start_ranks(self, ray: Any, held: _RayRanks, use_gpus: bool) -> None:
        described = ray.get([actor.describe.remote() for actor in held.actors])
        driver_node = ray.get_runtime_context().get_node_id()
        # Rank order: the driver's node first, then node by node (NCCL is fastest within a node).
        order = sorted(
            range(len(described)), key=lambda i: (described[i][0] != driver_node, described[i][0], i)
        )
        held.actors[:] = [held.actors[i] for i in order]
        described = [described[i] for i in order]
        self.rank_node_ids = [node for node, _, _, _ in described]
        self.worker_pids = [pid for _, _, _, pid in described]
        port = ray.get(held.actors[0].open_port.remote())
        init_method = f"tcp://{described[0][1]}:{port}"
        authkey = os.urandom(32)
        addresses = ray.get([actor.listen.remote(authkey) for actor in held.actors])
        for rank, (actor, (node, _, gpu_ids, _)) in enumerate(zip(held.actors, described)):
            node_gpus = sorted({gpu for n, _, ids, _ in described if n == node for gpu in ids}, key=int)
            local_rank = node_gpus.index(gpu_ids[0]) if use_gpus else 0
            visible = ",".join(node_gpus) if use_gpus else None
            held.loops.append(actor.run.remote(self.config, rank, local_rank, init_method, visible))
        conns = [Client(address, authkey=authkey) for address in addresses]
        for conn in conns:
            _no_delay(conn)
        loops = held.loops
        held.ranks = RankConnections(conns, find_dead_rank=lambda: _ended_rank(ray, loops))


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ValueError(
            "distributed_executor_backend='ray' needs Ray: pip install 'pagedllm[ray]' "
            "(or use 'mp' on one host)"
        ) from e
    return ray


def _sizes(parallel_config: ParallelConfig) -> str:
    text = f"tensor_parallel_size={parallel_config.tensor_parallel_size}"
    for name in ("context_parallel_size", "pipeline_parallel_size"):
        if getattr(parallel_config, name) > 1:
            text += f" x {name}={getattr(parallel_config, name)}"
    return text


def _check_cluster_size(ray: Any, parallel_config: ParallelConfig, device: str) -> None:
    """Refuse, before anything is placed or loaded, a cluster with fewer devices than ranks."""
    num_devices = int(ray.cluster_resources().get(device, 0))
    world_size = parallel_config.world_size
    if num_devices < world_size:
        alone = parallel_config.world_size == parallel_config.tensor_parallel_size
        lower = "tensor_parallel_size" if alone else "the sizes"
        raise ValueError(
            f"{_sizes(parallel_config)} needs {world_size} {device}s in the Ray cluster (one per rank), "
            f"and it has {num_devices}: add nodes (ray start --address=...) or lower {lower}"
        )


def _ended_rank(ray: Any, loops: list[Any]) -> str | None:
    """A rank whose loop has ended (its actor died or failed), described; None while all run."""
    ended, _ = ray.wait(loops, num_returns=1, timeout=0)
    if not ended:
        return None
    rank = loops.index(ended[0])
    try:
        ray.get(ended[0])
        return f"rank {rank} stopped serving"
    except Exception as e:
        return f"rank {rank} died: {type(e).__name__}: {e}"


def _release(ray: Any, held: _RayRanks) -> None:
    from ray.util.placement_group import remove_placement_group

    if held.ranks is not None and held.ranks.failure is None:
        held.ranks.send_shutdown()
        ray.wait(held.loops, num_returns=len(held.loops), timeout=SHUTDOWN_GRACE_S)
    for actor in held.actors:
        ray.kill(actor)
    if held.ranks is not None:
        held.ranks.close()
    remove_placement_group(held.placement_group)


def _no_delay(conn: Connection) -> None:
    """Send each frame at once: Nagle's algorithm would hold a step's small message back."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
