"""Runs the one worker of a single-device engine in the engine's own process."""

from __future__ import annotations

from typing import Any

from pagedllm.executor.abstract import Executor, WorkerCall, call_worker
from pagedllm.step_io import SchedulerOutput, StepHandle
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    """One rank, called directly: no process, no message, no copy."""

    rank_zero_in_process = True

    def _init_workers(self) -> None:
        self.worker = Worker(self.config)

    def collective_rpc(
        self, method: WorkerCall, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return [call_worker(self.worker, method, args, kwargs)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Launch the step; its samples come from the returned handle's ``get()``."""
        return self.worker.execute_model(scheduler_output)
