"""A worker owns one device: its model replica (or shard), its KV cache, and its step."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pagedllm.attention.backends import get_attn_backend
from pagedllm.attention.kv_quant import check_kv_cache_dtype
from pagedllm.config import EngineConfig, GiB, kv_cache_torch_dtype
from pagedllm.distributed import init_distributed_environment, pipeline_stage_layers
from pagedllm.layers.onednn_linear import onednn_available, prepack_dense_weights
from pagedllm.lora.request import LoRARequest
from pagedllm.models.utils import kv_cache_window
from pagedllm.step_io import SchedulerOutput
from pagedllm.worker.cache_engine import CacheEngine, KVCacheSpec
from pagedllm.worker.model_runner import ModelRunner, StepOutput
from pagedllm.worker.pooling_runner import PoolingModelRunner
from pagedllm.worker.profiler import WorkerProfiler
from pagedllm.worker.state_cache import (
    StateCache,
    kv_budget_after_state,
    num_kv_cache_layers,
    state_cache_spec,
)


class Worker:
    """Args:
    config: the engine's configuration (the same on every rank).
    rank: this worker's rank, in [0, world_size): tensor-parallel rank ``rank % tp`` of pipeline
        stage ``rank // tp`` (distributed/parallel_state.py).
    local_rank: its index among the GPUs of its host: it runs on cuda:local_rank.
    distributed_init_method: where the ranks meet ("tcp://host:port"); None for one rank.
    """

    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str | None = None,
    ) -> None:
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.device = rank_device(config, local_rank)
        self.profiler = WorkerProfiler(rank, self.device)
        # This rank's view of the configuration: its own device, which the model runner reads.
        self.config = config = dataclasses.replace(
            config, device_config=dataclasses.replace(config.device_config, device=self.device)
        )
        model_config, cache_config = config.model_config, config.cache_config
        self.attn_backend = get_attn_backend(
            config.attention_backend,
            self.device,
            config.batch_invariant,
            context_parallel=config.parallel_config.context_parallel_size > 1,
        )
        self.attn_backend.check_model_supported(model_config, cache_config.block_size, self.device)
        kv_cache_dtype = kv_cache_torch_dtype(cache_config.cache_dtype, model_config.dtype)
        check_kv_cache_dtype(self.attn_backend, kv_cache_dtype)
        parallel_config = config.parallel_config
        # This rank's pipeline stage's layers (all of them with one stage).
        stage = pipeline_stage_layers(
            model_config.num_layers,
            parallel_config.rank_layout(rank)[0],
            parallel_config.pipeline_parallel_size,
        )
        self.state_cache_spec = state_cache_spec(config, stage)
        self.state_cache: StateCache | None = None
        self.kv_cache_spec = KVCacheSpec(
            num_layers=num_kv_cache_layers(config, stage),
            num_kv_heads=model_config.num_kv_heads_per_rank(parallel_config.tensor_parallel_size),
            head_size=model_config.head_size,
            block_size=cache_config.block_size,
            dtype=kv_cache_dtype,
            sliding_window=kv_cache_window(model_config.hf_config),
            keys_only=model_config.is_mla,
            num_state_slots=self.state_cache_spec.num_slots if self.state_cache_spec else 0,
        )
        # A pooling model's runner pools finished prompts where a generating one samples.
        runner_class = ModelRunner if config.pooler_config is None else PoolingModelRunner
        self.model_runner = runner_class(config, self.attn_backend, rank)
        self.cache_engine: CacheEngine | None = None

    def init_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.config.device_config.num_threads is not None:
            torch.set_num_threads(self.config.device_config.num_threads)
        parallel_config = self.config.parallel_config
        if parallel_config.world_size > 1:
            assert self.distributed_init_method is not None, "several ranks need a distributed_init_method"
            spec = self.config.speculative_config
            init_distributed_environment(
                parallel_config.world_size,
                self.rank,
                self.distributed_init_method,
                self.device,
                custom_all_reduce=not parallel_config.disable_custom_all_reduce,
                tensor_parallel_size=parallel_config.tensor_parallel_size,
                context_parallel_size=parallel_config.context_parallel_size,
                # EAGLE-3's hooks read the target's layer outputs, whole, before the next norm.
                reductions_in_norms=spec is None or spec.method != "eagle3",
            )
        # The same seed on every rank: ranks sample the same tokens from the same gathered logits.
        torch.manual_seed(self.config.model_config.seed)

    def load_model(self) -> None:
        if self.device.type == "cuda":
            self._check_weights_fit()
        self.model_runner.load_model()
        if self.state_cache_spec is not None:
            if self.device.type == "cuda":  # refuse it before an allocation fails
                free, total = torch.cuda.mem_get_info(self.device)
                utilization = self.config.cache_config.gpu_memory_utilization
                kv_budget_after_state(int(min(free, total * utilization)), self.state_cache_spec)
            # Before the profile run: on a GPU the profiler then counts the state as in use.
            self.state_cache = StateCache(self.state_cache_spec, self.device)
            self.state_cache.bind(self.model_runner.model)
            self.model_runner.has_state = True
        if self.device.type == "cpu" and onednn_available(self.config.model_config.dtype):
            prepack_dense_weights(self.model_runner.model)
            if self.model_runner.drafter is not None and self.model_runner.drafter.model is not None:
                prepack_dense_weights(self.model_runner.drafter.model)
        if self.config.batch_invariant and self.device.type == "cuda":
            from pagedllm.layers.batch_invariant_linear import use_batch_invariant_gemms

            use_batch_invariant_gemms(self.model_runner.model, self.device)

    def _check_weights_fit(self) -> None:
        """Refuse, before loading anything, a model whose weights alone exceed the memory budget."""
        from pagedllm.model_loader import estimate_model_bytes

        weight_bytes = estimate_model_bytes(self.config.model_config, self.attn_backend)
        free, total = torch.cuda.mem_get_info(self.device)
        utilization = self.config.cache_config.gpu_memory_utilization
        budget = min(free, total * utilization)
        if weight_bytes > budget:
            raise ValueError(
                f"the model's weights need {weight_bytes / GiB:.1f} GiB in {self.config.model_config.dtype}, "
                f"more than the {budget / GiB:.1f} GiB this GPU can give (free {free / GiB:.1f} GiB, "
                f"gpu_memory_utilization {utilization} of {total / GiB:.1f} GiB)"
            )

    def get_kv_cache_spec(self) -> KVCacheSpec:
        """The cache this rank's model needs, for the engine's scheduler (vLLM's name)."""
        return self.kv_cache_spec

    def determine_num_available_blocks(self) -> tuple[int | None, int | None]:
        """(device blocks, CPU swap blocks) that fit the memory budget (vLLM's design's
        profile_num_available_blocks); None for no bound, on a pipeline stage none of whose layers
        caches K/V (recurrent layers only: a block costs it nothing).

        On a GPU, one forward pass at the scheduler's largest step (max_num_batched_tokens) finds
        the activation peak; what ``gpu_memory_utilization`` leaves after it, the weights and
        everything else on the device is KV cache. On the CPU the budget is ``kv_cache_memory``
        bytes. ``num_kv_blocks`` overrides the device count on any device.
        """
        cache_config = self.config.cache_config
        block_bytes = self.kv_cache_spec.block_bytes
        # A draft model's cache shares the block ids: a block costs both models' bytes, and the
        # draft's scratch blocks come off the budget first (worker/draft_model.py).
        drafter = self.model_runner.drafter
        reserved = 0 if drafter is None else drafter.scratch_bytes
        block_bytes += 0 if drafter is None else drafter.block_bytes
        num_cpu_blocks = _blocks_in(int(cache_config.swap_space * GiB), block_bytes)
        if cache_config.num_kv_blocks is not None:
            return cache_config.num_kv_blocks, num_cpu_blocks
        if self.device.type == "cpu":
            budget = kv_budget_after_state(cache_config.kv_cache_memory, self.state_cache_spec)
            return _blocks_in(budget - reserved, block_bytes), num_cpu_blocks
        return self._profile_num_gpu_blocks(block_bytes, reserved), num_cpu_blocks

    def _profile_num_gpu_blocks(self, block_bytes: int, reserved: int = 0) -> int | None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        one_block = CacheEngine(self.kv_cache_spec, self.attn_backend, 1, 0, self.device)
        self.model_runner.profile_run(one_block.gpu_cache)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - baseline
        del one_block
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # Everything in use now (weights, the CUDA context, other engines and processes), plus
        # what a step at the scheduler's largest size adds on top: the rest of the share is cache.
        in_use = total - free
        utilization = self.config.cache_config.gpu_memory_utilization
        budget = total * utilization - in_use - activation_peak - reserved
        if block_bytes == 0:  # profiled all the same: the other stages' profile runs need this one
            return None
        num_blocks = int(budget // block_bytes)
        if num_blocks <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache: {in_use / GiB:.1f} GiB is in use (weights, "
                f"context, other processes) and a step at max_num_batched_tokens adds "
                f"{activation_peak / GiB:.1f} GiB, out of {utilization} x {total / GiB:.1f} GiB; raise "
                "gpu_memory_utilization or lower max_num_batched_tokens"
            )
        return num_blocks

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_engine = CacheEngine(
            self.kv_cache_spec, self.attn_backend, num_gpu_blocks, num_cpu_blocks, self.device
        )
        if self.model_runner.drafter is not None:
            self.model_runner.drafter.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        self.model_runner.initialize_kv_cache(self.cache_engine.gpu_cache)
        self.model_runner.capture_model()

    # --- LoRA adapters, read on the loader thread (lora/loader.py's LoRALoadGate calls these) ---

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Start reading the adapter off the step's thread; whether it is on the host already."""
        assert self.model_runner.lora_manager is not None, "enable_lora is off"
        return self.model_runner.lora_manager.add_lora(lora_request)

    def lora_load_states(self, lora_int_ids: list[int], timeout: float) -> tuple[set[int], dict[int, str]]:
        """(the adapters among ``lora_int_ids`` on the host, those that failed with why)."""
        assert self.model_runner.lora_manager is not None, "enable_lora is off"
        return self.model_runner.lora_manager.loader.states(lora_int_ids, timeout)

    # --- profiling (LLM.start_profile / stop_profile) ---

    def start_profile(self, torch_profiler: bool = True) -> None:
        self.profiler.start(torch_profiler)

    def stop_profile(self) -> dict[str, Any]:
        """This rank's profile since ``start_profile`` (profiler.py)."""
        return self.profiler.stop()

    def execute_model(self, scheduler_output: SchedulerOutput) -> StepOutput:
        """Do the step's block moves, then its forward pass and sampling (without waiting for the
        samples: ``StepOutput.get`` does)."""
        assert self.cache_engine is not None, "initialize_cache() first"
        if self.profiler.active:
            self.profiler.step_started()
        block_moves = (
            scheduler_output.blocks_to_swap_out,
            scheduler_output.blocks_to_swap_in,
            scheduler_output.blocks_to_copy,
        )
        self.cache_engine.run_cache_ops(*block_moves)
        if scheduler_output.state_slots_to_copy:
            assert self.state_cache is not None, "state copies for a model without recurrent state"
            self.state_cache.copy_slots(scheduler_output.state_slots_to_copy)
        if self.model_runner.drafter is not None:
            self.model_runner.drafter.run_cache_ops(*block_moves)
        step = self.model_runner.execute_model(scheduler_output)
        if self.profiler.active:
            self.profiler.step_issued()
        return step

    def execute_model_remote(self, scheduler_output: SchedulerOutput) -> StepOutput | None:
        """``execute_model`` for a rank in another process: the output rank (the last pipeline
        stage's first) returns the step's handle (the worker loop sends its samples once they reach
        the host, while this rank goes on to the next step); the other ranks return None, their
        samples being the output rank's."""
        step = self.execute_model(scheduler_output)
        return step if self.rank == self.config.parallel_config.output_rank else None


def _blocks_in(budget: int, block_bytes: int) -> int | None:
    return None if block_bytes == 0 else max(budget, 0) // block_bytes


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """The device of the rank with index ``local_rank`` on its host: the configured device for a
    single rank, cuda:local_rank (or the CPU) for several."""
    device = config.device_config.device
    if config.parallel_config.world_size == 1 or device.type != "cuda":
        return device
    return torch.device("cuda", local_rank)
