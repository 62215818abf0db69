"""A worker owns one device: its model replica (or shard), its KV cache, and its step."""

from __future__ import annotations

import torch

from pagedllm.attention.backends import get_attn_backend
from pagedllm.config import EngineConfig, GiB
from pagedllm.worker.cache_engine import CacheEngine, KVCacheSpec
from pagedllm.worker.execute_request import ExecuteModelRequest, ModelRunnerOutput
from pagedllm.worker.model_runner import ModelRunner


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device_config.device
        model_config, cache_config = config.model_config, config.cache_config
        self.attn_backend = get_attn_backend(config.attention_backend, self.device)
        self.attn_backend.check_supported(
            model_config.head_size, cache_config.block_size, model_config.dtype, self.device
        )
        self.kv_cache_spec = KVCacheSpec(
            num_layers=model_config.num_layers,
            num_kv_heads=model_config.num_kv_heads_per_rank(config.parallel_config.tensor_parallel_size),
            head_size=model_config.head_size,
            block_size=cache_config.block_size,
            dtype=model_config.dtype,
        )
        self.model_runner = ModelRunner(config, self.attn_backend)
        self.cache_engine: CacheEngine | None = None
        # Seeded requests' generators, on this device, kept until the request finishes.
        self.generators: dict[str, torch.Generator] = {}

    def init_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(self.config.model_config.seed)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) that fit the memory budget (seed 000's
        profile_num_available_blocks). On the CPU the device budget is ``kv_cache_memory``
        bytes; ``num_kv_blocks`` overrides the device count on any device."""
        cache_config = self.config.cache_config
        block_bytes = self.kv_cache_spec.block_bytes
        if cache_config.num_kv_blocks is not None:
            num_gpu_blocks = cache_config.num_kv_blocks
        elif self.device.type == "cpu":
            num_gpu_blocks = cache_config.kv_cache_memory // block_bytes
        else:
            raise NotImplementedError(
                "sizing the KV cache on a GPU needs num_kv_blocks until GPU profiling lands"
            )
        num_cpu_blocks = int(cache_config.swap_space * GiB) // block_bytes
        return num_gpu_blocks, num_cpu_blocks

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_engine = CacheEngine(
            self.kv_cache_spec, self.attn_backend, num_gpu_blocks, num_cpu_blocks, self.device
        )

    def execute_model(self, request: ExecuteModelRequest) -> ModelRunnerOutput:
        assert self.cache_engine is not None, "initialize_cache() first"
        for request_id in request.finished_request_ids:
            self.generators.pop(request_id, None)
        # Swap-outs read blocks that this step's copies and prefills may reuse: they go first.
        self.cache_engine.swap_out(request.blocks_to_swap_out)
        self.cache_engine.swap_in(request.blocks_to_swap_in)
        self.cache_engine.copy(request.blocks_to_copy)
        if not request.seq_groups:
            return ModelRunnerOutput(samples={})
        for group in request.seq_groups:
            seed = group.sampling_params.seed
            if seed is not None and group.request_id not in self.generators:
                self.generators[group.request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self.model_runner.execute_model(
            request.seq_groups, self.cache_engine.gpu_cache, self.generators
        )
