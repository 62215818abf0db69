"""Runs the one worker of a single-device engine in the engine's own process."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.worker.model_runner import StepOutput
from pagedllm.worker.step_io import SchedulerOutput
from pagedllm.worker.worker import Worker


class UniProcExecutor:
    """The seam where tensor parallelism plugs in: the engine talks only to an executor."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()

    def determine_num_available_blocks(self) -> tuple[int, int]:
        return self.worker.determine_num_available_blocks()

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.initialize_cache(num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> StepOutput:
        """Launch the step; its samples come from the returned handle's ``get()``."""
        return self.worker.execute_model(scheduler_output)
