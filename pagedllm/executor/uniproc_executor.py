"""Runs the one worker of a single-device engine in the engine's own process."""

from __future__ import annotations

from typing import Any

from pagedllm.executor.abstract import Executor, ExecutorDeadError, WorkerCall, call_worker
from pagedllm.step_io import SchedulerOutput, StepHandle
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    """One rank, called directly: no process, no message, no copy."""

    rank_zero_in_process = True

    def _init_workers(self) -> None:
        self._worker: Worker | None = Worker(self.config)

    @property
    def worker(self) -> Worker:
        if self._worker is None:
            raise ExecutorDeadError("the engine was shut down")
        return self._worker

    def collective_rpc(
        self, method: WorkerCall, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return [call_worker(self.worker, method, args, kwargs)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Launch the step; its samples come from the returned handle's ``get()``."""
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        """Let the worker go: its weights, KV cache and graphs return to the allocator even while
        the caller keeps the engine object (a second engine in the same process then sizes its
        cache from the memory really free)."""
        self._worker = None
