"""Data parallelism for serving: N engine cores behind one frontend (vLLM's DP engine client).

```
             frontend (one event loop: tokenize, route, detokenize once)
                                   |
                      DataParallelCore  (this module)
          route(AddRequest) -> i   |   aborts and stop-string finishes -> the request's replica
          +-------------------+----+--------------------+
   engine process 0      engine process 1   ...   engine process N-1
   devices [0, tp)       devices [tp, 2tp)        devices [(N-1)tp, N tp)
```

``pagedllm serve --data-parallel-size N`` starts N engine-core processes (each the
``in_engine_process`` core, each with ``tensor_parallel_size`` ranks of its own) and wraps them
in a ``DataParallelCore``, which the AsyncLLMEngine drives exactly as it drives one: the same
ops go in, the same messages come out. Only token ids cross the pipes; text is made once, in
the frontend. Each new request goes where ``DataParallelRouter`` says (least loaded, prefix
affinity); the router remembers it there, so its abort and its stop-string finishes follow it.

Devices: replica i sees devices ``[i * tp, (i + 1) * tp)`` of those visible to the server, through
``CUDA_VISIBLE_DEVICES`` set in its process's environment before it starts (so before CUDA is
initialised there). On the CPU each replica is a process with its own threads: unless
``--threads`` is given, each rank of each replica gets ``physical cores // (N * tp)``.

Failures, as vLLM: a replica that dies (or fails its loop) makes the whole engine dead: every
request in flight, on every replica, fails at once with AsyncEngineDeadError, /health answers
503, and the server exits non-zero for its supervisor to restart it. A replica that stops
answering (stuck, not dead) turns /health 503 after the heartbeat timeout, as one engine does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from pagedllm.config import EngineConfig
from pagedllm.cpu_info import physical_cpu_cores
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_messages import (
    AbortRequests,
    AddRequest,
    CoreMessage,
    CoreOp,
    CoreOutputs,
    EngineDead,
    FinishSequences,
)
from pagedllm.engine.dp_router import DataParallelRouter
from pagedllm.engine.stats import EngineStats, sum_engine_stats
from pagedllm.parallel_config import ranks_field

# The tokenizer module imports transformers (seconds): the engine's processes start before it.
if TYPE_CHECKING:
    from pagedllm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineCoreClient(Protocol):
    """One engine core as the frontend reaches it (async_engine's process core)."""

    config: EngineConfig
    tokenizer: Tokenizer | None
    num_gpu_blocks: int
    initial_stats: EngineStats

    def wait_ready(self) -> None: ...
    def start(self, deliver: Callable[[CoreMessage], None]) -> None: ...
    def send(self, op: CoreOp) -> None: ...
    def is_alive(self) -> bool: ...
    def close(self, timeout: float) -> None: ...


# (engine args, environment, process name) -> a started engine core process.
CoreFactory = Callable[[EngineArgs, dict[str, str], str], EngineCoreClient]


def check_data_parallel(engine_args: EngineArgs) -> None:
    """Refuse, before anything loads, sizes the server cannot run, naming them."""
    dp, tp = engine_args.data_parallel_size, replica_size(engine_args)
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ValueError(f"data_parallel_size must be an int >= 1, got {dp!r}")
    if dp == 1:
        return
    if engine_args.distributed_executor_backend == "ray":
        raise ValueError(
            "data_parallel_size > 1 runs its replicas as processes of this host; with "
            "distributed_executor_backend='ray' (which places every rank itself) use data_parallel_size=1"
        )
    device = engine_args.device
    if device.startswith("cuda:"):
        raise ValueError(
            f"device={device!r} with data_parallel_size={dp}: each replica takes its own devices; "
            "give device='cuda' (or 'auto') and choose the GPUs with CUDA_VISIBLE_DEVICES"
        )
    if device == "cpu":
        return
    num_visible = len(visible_cuda_devices())
    if device == "cuda" and num_visible == 0:
        raise ValueError("device='cuda' was asked for, but no CUDA device is visible")
    if num_visible and dp * tp > num_visible:
        sizes = ranks_field(engine_args.pipeline_parallel_size, engine_args.context_parallel_size)
        raise ValueError(
            f"data_parallel_size ({dp}) x {sizes} ({tp}) = {dp * tp} devices, but "
            f"{num_visible} CUDA devices are visible: data_parallel_size <= {max(num_visible // tp, 1)} "
            f"at {sizes}={tp} (one device per rank of every replica)"
        )


def replica_size(engine_args: EngineArgs) -> int:
    """The ranks (devices) of one replica: tensor x context x pipeline parallel sizes."""
    args = engine_args
    return args.tensor_parallel_size * args.context_parallel_size * args.pipeline_parallel_size


def visible_cuda_devices() -> list[str]:
    """The CUDA devices this process may use, as CUDA_VISIBLE_DEVICES names them."""
    import torch

    count = torch.cuda.device_count()  # NVML: the replicas' processes may still fork their ranks
    names = os.environ.get("CUDA_VISIBLE_DEVICES")
    if names is None:
        return [str(index) for index in range(count)]
    return [name.strip() for name in names.split(",") if name.strip()][:count]


def replica_engine_args(engine_args: EngineArgs, on_cuda: bool) -> EngineArgs:
    """A replica's own arguments: one engine, CPU threads split between the replicas. The
    seed stays: the replicas are one model (``--load-format dummy`` draws its weights from it)."""
    dp, tp = engine_args.data_parallel_size, replica_size(engine_args)
    threads = engine_args.threads
    if threads is None and not on_cuda:
        threads = max(1, physical_cpu_cores() // (dp * tp))
    return dataclasses.replace(engine_args, data_parallel_size=1, threads=threads)


def replica_env(rank: int, num_ranks: int, devices: list[str]) -> dict[str, str]:
    """Replica ``rank``'s environment: its slice of ``num_ranks`` of the visible CUDA devices (none
    on the CPU)."""
    if not devices:
        return {}
    mine = devices[rank * num_ranks : (rank + 1) * num_ranks]
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` set, restored on exit: a process spawned inside starts with it."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_replicas(engine_args: EngineArgs, make_core: CoreFactory) -> list[EngineCoreClient]:
    """Check the sizes and start every replica's process; ``wait_for_replicas`` waits for them
    (they load their models at once, not one after another)."""
    check_data_parallel(engine_args)
    devices = visible_cuda_devices() if engine_args.device != "cpu" else []
    cores: list[EngineCoreClient] = []
    try:
        for rank in range(engine_args.data_parallel_size):
            args = replica_engine_args(engine_args, on_cuda=bool(devices))
            env = replica_env(rank, replica_size(engine_args), devices)
            cores.append(make_core(args, env, f"pagedllm-engine-dp{rank}"))
    except BaseException:
        for core in cores:
            core.close(0.0)
        raise
    return cores


def wait_for_replicas(cores: list[EngineCoreClient]) -> DataParallelCore:
    """The replicas of ``start_replicas`` as one core, once all have loaded their model. Raises
    what a replica raised while starting, after stopping the others."""
    try:
        for core in cores:
            core.wait_ready()
    except BaseException:
        for core in cores:
            core.close(0.0)
        raise
    config = cores[0].config
    logger.info(
        "%d data-parallel engine replicas ready, each on %d %s",
        len(cores),
        config.parallel_config.tensor_parallel_size,
        "GPU(s)" if config.device_config.device.type == "cuda" else "CPU rank(s)",
    )
    return DataParallelCore(cores)


class DataParallelCore:
    """N engine cores driven as one (the AsyncLLMEngine's core); see the module docstring.

    ``send`` is called from the event loop only (as the AsyncLLMEngine does); the replicas'
    messages arrive on their reader threads and go on to ``deliver`` unchanged, except that each
    step's stats become the sum over the replicas (each replica's own: ``engine_stats``).
    """

    def __init__(self, cores: list[EngineCoreClient]) -> None:
        self.cores = cores
        first = cores[0]
        self.config = first.config
        self.tokenizer = first.tokenizer
        # A request must fit in any replica's cache (they are alike unless memory differs).
        self.num_gpu_blocks = min(core.num_gpu_blocks for core in cores)
        self.engine_stats: list[EngineStats] = [core.initial_stats for core in cores]
        self.initial_stats = sum_engine_stats(self.engine_stats)
        self.router = DataParallelRouter(
            len(cores),
            self.config.scheduler_block_size,
            prefix_affinity=self.config.cache_config.enable_prefix_caching,
        )
        self._last_heard = [time.monotonic()] * len(cores)

    def start(self, deliver: Callable[[CoreMessage], None]) -> None:
        self._last_heard = [time.monotonic()] * len(self.cores)
        for engine, core in enumerate(self.cores):
            core.start(self._deliver_from(engine, deliver))

    def _deliver_from(
        self, engine: int, deliver: Callable[[CoreMessage], None]
    ) -> Callable[[CoreMessage], None]:
        def on_message(message: CoreMessage) -> None:
            self._last_heard[engine] = time.monotonic()
            if isinstance(message, CoreOutputs):
                self.engine_stats[engine] = message.stats
                message = CoreOutputs(message.outputs, sum_engine_stats(self.engine_stats))
            elif isinstance(message, EngineDead):
                message = EngineDead(f"data-parallel engine {engine} of {len(self.cores)}: {message.reason}")
            deliver(message)

        return on_message

    def seconds_since_heard(self) -> float:
        """Since the replica heard from least recently last sent anything."""
        return time.monotonic() - min(self._last_heard)

    def send(self, op: CoreOp) -> None:
        if op is None:
            for core in self.cores:
                core.send(None)
        elif isinstance(op, AddRequest):
            request = op.request
            salt = None if request.lora_request is None else request.lora_request.cache_salt
            self.cores[self.router.route(request.request_id, request.prompt_token_ids, salt)].send(op)
        elif isinstance(op, AbortRequests):
            for engine, request_ids in self._by_engine(op.request_ids, lambda request_id: request_id):
                self.cores[engine].send(AbortRequests(request_ids))
        else:
            for engine, stopped in self._by_engine(op.stopped, lambda entry: entry[0]):
                self.cores[engine].send(FinishSequences(stopped))

    def _by_engine(self, items: Iterable, request_id_of: Callable) -> Iterable[tuple[int, list]]:
        """``items`` grouped by the replica of their request; an item of a request the router
        forgot goes to every replica (ending what a replica does not hold does nothing)."""
        groups: dict[int, list] = defaultdict(list)
        for item in items:
            engine = self.router.engine_of(request_id_of(item))
            for target in range(len(self.cores)) if engine is None else (engine,):
                groups[target].append(item)
        return groups.items()

    def is_alive(self) -> bool:
        return all(core.is_alive() for core in self.cores)

    def close(self, timeout: float) -> None:
        # Every replica is told to stop first, so that they wind down together.
        for core in self.cores:
            core.send(None)
        for core in self.cores:
            core.close(timeout)
