"""The benchmark's random adapters are adapters the engine takes, and ``run`` spreads them over
its requests."""

from __future__ import annotations

import argparse

from transformers import LlamaConfig, Qwen3MoeConfig

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.bench import throughput
from pagedllm.entrypoints.bench.lora_adapters import write_random_adapters
from pagedllm.entrypoints.bench.workloads import WORKLOADS
from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.peft import check_adapter


def test_random_adapters_fit_their_model(make_tiny_model, tmp_path):
    _, model_config = make_tiny_model(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    loras = write_random_adapters(model_config.hf_config, 3, 8, str(tmp_path))
    assert [lora.lora_int_id for lora in loras] == [1, 2, 3]
    for lora in loras:
        spec = check_adapter(lora, model_config.hf_config, LoRAConfig(max_lora_rank=8))
        assert spec.rank == 8 and len(spec.target_modules) == 7


def test_random_adapters_of_a_mixture_of_experts_adapt_attention_only(tmp_path):
    config = Qwen3MoeConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_experts=4)
    (lora,) = write_random_adapters(config, 1, 4, str(tmp_path))
    spec = check_adapter(lora, config, LoRAConfig(max_lora_rank=4))
    assert spec.target_modules == ["k_proj", "o_proj", "q_proj", "v_proj"]


def test_the_throughput_run_spreads_adapters_over_its_requests(make_tiny_model, tmp_path):
    _, model_config = make_tiny_model(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    parser = throughput.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--model", model_config.model, "--device", "cpu", "--load-format", "auto", "--num-loras", "3",
         "--lora-rank", "4", "--max-model-len", "64", "--max-num-seqs", "8"]
    )  # fmt: skip
    engine_args = throughput.engine_args_for(WORKLOADS["W1"], args)
    assert engine_args.enable_lora and engine_args.max_loras == 3 and engine_args.max_lora_rank >= 4
    engine = LLMEngine.from_engine_args(engine_args)
    loras = write_random_adapters(model_config.hf_config, 3, 4, str(tmp_path))
    result = throughput.run(engine, [[1, 2, 3, 4]] * 5, 3, lora_requests=loras)
    assert result["output_tokens"] == 15 and result["num_requests"] == 5
    # Every adapter was slotted on the worker.
    assert sorted(engine.executor.worker.model_runner.lora_manager.lora_slots) == [1, 2, 3]
