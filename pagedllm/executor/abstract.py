"""The engine's one handle on its workers, whatever runs them.

Two kinds of call cross it. Setup calls (load the model, profile memory, allocate the cache,
capture graphs) go to every rank through ``collective_rpc`` and return every rank's answer. The
per-step call, ``execute_model(msg)``, sends one small picklable message (the scheduler's output
for the step) to every rank and returns one rank's result only (rank 0's, or with pipeline
stages the last stage's first rank's): all ranks of the last stage compute the same sampled
tokens (they all gather the full logits), so one copy is enough.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.config import EngineConfig
from pagedllm.step_io import SchedulerOutput, StepHandle

if TYPE_CHECKING:
    from pagedllm.worker.cache_engine import KVCacheSpec


class ExecutorDeadError(RuntimeError):
    """A worker died, failed or stopped answering: this executor cannot run another step."""


# A worker method's name, or a function called as fn(worker, *args, **kwargs) on every rank.
WorkerCall = str | Callable[..., Any]


class Executor:
    """Runs ``world_size`` workers (tensor x context x pipeline parallel sizes) and talks to
    them; subclasses choose where they run.

    Construction starts the workers, joins their process group and loads the model's shards.
    """

    # Whether rank 0 runs in this process: a grammar compiled here then reaches its matcher
    # as is; a rank 0 elsewhere compiles the constraint itself.
    rank_zero_in_process: bool = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_workers()
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def _init_workers(self) -> None:
        raise NotImplementedError

    def collective_rpc(
        self, method: WorkerCall, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Call ``method`` on every rank's worker; returns the results in rank order."""
        raise NotImplementedError

    def execute_model(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Launch one step, ``Worker.execute_model`` on every rank, and return at once; the
        handle's ``get()`` gives the output rank's samples."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise ExecutorDeadError when a worker is gone; a no-op while all are alive."""

    def shutdown(self) -> None:
        """Stop the workers and release what they hold; safe to call more than once."""

    # --- setup, on every rank ---------------------------------------------------------------

    def get_kv_cache_spec(self) -> KVCacheSpec:
        """The KV cache the model needs (rank 0's: every rank's differs only in its head count and,
        with pipeline stages, its layers; each rank sizes its own blocks)."""
        return self.collective_rpc("get_kv_cache_spec")[0]

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) that fit on every rank: each rank profiles its own
        device, and the smallest answer is what all of them allocate."""
        answers = self.collective_rpc("determine_num_available_blocks")
        # None: a rank whose layers cache no K/V (a pipeline stage of recurrent layers) sets no bound.
        gpu = [num for num, _ in answers if num is not None]
        cpu = [num for _, num in answers if num is not None]
        if not gpu:
            raise ValueError(
                "no layer of the model keeps a KV cache: pagedllm runs models with attention layers"
            )
        return min(gpu), min(cpu)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the KV cache (and capture CUDA graphs) on every rank."""
        self.collective_rpc("initialize_cache", (num_gpu_blocks, num_cpu_blocks))


def call_worker(
    worker: Any, method: WorkerCall, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
) -> Any:
    """``worker.method(*args, **kwargs)``, or ``method(worker, *args, **kwargs)`` for a function."""
    if isinstance(method, str):
        return getattr(worker, method)(*args, **(kwargs or {}))
    return method(worker, *args, **(kwargs or {}))
