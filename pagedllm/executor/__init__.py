"""Where the ranks of an engine run: in process (``uni``), in spawned processes (``mp``) or in Ray
actors (``ray``), behind one Executor interface (``abstract.py``)."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import Executor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor of ``distributed_executor_backend``: "uni", "mp" or "ray"."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "mp":
        from pagedllm.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor
    from pagedllm.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor
