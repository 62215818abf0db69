"""The W5 workload and its floor, and ``pagedllm bench moe``'s arguments, without a GPU.
tests/gpu/test_fused_moe_gpu.py runs the kernel benchmark itself."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import AutoConfig, MixtralConfig, Qwen3MoeConfig

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.entrypoints.bench import moe as bench_moe
from pagedllm.entrypoints.bench.moe_floor import MoeShape, moe_floor
from pagedllm.entrypoints.bench.workloads import WORKLOADS
from pagedllm.models import get_model_class


def _meta_params(config) -> dict[str, int]:
    """Parameter counts of our model of ``config``, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = get_model_class(config.architectures)(config, TorchAttentionBackend)
    return {name: p.numel() for name, p in model.named_parameters()}


def test_w5_is_qwen3_30b_a3b() -> None:
    workload = WORKLOADS["W5"]
    assert (workload.num_prompts, workload.input_len, workload.output_len) == (512, (100, 1024), 256)
    config = AutoConfig.from_pretrained(workload.model)
    assert config.architectures == ["Qwen3MoeForCausalLM"]
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 768)
    total = sum(_meta_params(config).values())
    assert 30.4e9 < total < 30.6e9  # "30B"
    assert 2.6e9 < MoeShape.from_config(config).active_params_per_token < 2.8e9  # "A3B" less embeddings


@pytest.mark.parametrize(
    "config",
    [
        Qwen3MoeConfig(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
            decoder_sparse_step=1,
            architectures=["Qwen3MoeForCausalLM"],
        ),
        MixtralConfig(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            architectures=["MixtralForCausalLM"],
        ),
    ],
)
def test_a_step_touching_every_expert_reads_every_matrix(config) -> None:
    shape = MoeShape.from_config(config)
    params = _meta_params(config)
    # Every weight but the embedding (a decode step reads B rows of it) and the norms.
    matrices = sum(n for name, n in params.items() if "norm" not in name and "embed_tokens" not in name)
    assert shape.decode_step_params(10_000) == pytest.approx(matrices)
    experts = sum(n for name, n in params.items() if ".experts." in name)
    assert shape.decode_step_params(1) == pytest.approx(
        matrices - experts * (1 - shape.top_k / shape.num_experts)
    )


def test_expected_experts_touched() -> None:
    shape = MoeShape.from_config(AutoConfig.from_pretrained(WORKLOADS["W5"].model))
    assert shape.expected_experts(0) == 0
    assert shape.expected_experts(1) == pytest.approx(8)
    assert shape.expected_experts(2) == pytest.approx(8 + 8 * 120 / 128)  # the second token's new experts
    assert shape.expected_experts(256) == pytest.approx(128, abs=1e-3)


def test_floor_of_one_request() -> None:
    config = Qwen3MoeConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=1,
    )
    shape = MoeShape.from_config(config)
    floor = moe_floor(
        shape, [10], output_len=4, max_num_seqs=8, element_size=2, bandwidth=1e9, peak_flops=1e12
    )
    # Three decode steps of one token, contexts 11, 12, 13; K and V of 2 layers x 2 heads x 8.
    assert floor["kv_tb"] * 1e12 == (11 + 12 + 13) * 2 * 2 * 2 * 8 * 2
    assert floor["decode_weight_tb"] * 1e12 == pytest.approx(3 * shape.decode_step_params(1) * 2)
    attention = 4 * 2 * 4 * 8 * 10 * 11 // 2
    assert floor["prefill_tflop"] * 1e12 == 2 * shape.active_params_per_token * 10 + attention + 2 * 100 * 32
    assert floor["floor_s"] == pytest.approx(floor["decode_weight_s"] + floor["kv_s"] + floor["prefill_s"])


def test_bench_moe_defaults_are_qwen3_30b_a3b_at_decode_and_prefill_sizes() -> None:
    parser = argparse.ArgumentParser()
    bench_moe.add_cli_args(parser)
    args = parser.parse_args([])
    assert args.num_tokens == [64, 8192]
    assert (args.num_experts, args.top_k, args.hidden_size, args.intermediate_size) == (128, 8, 2048, 768)
