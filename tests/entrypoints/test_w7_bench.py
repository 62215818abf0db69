"""W7 (DeepSeek-V2-Lite's config, W1's requests) and its floor's MLA and shared-expert terms, without
a GPU: the parameter counts against our model built on the meta device, the KV bytes per token
against the cache the engine allocates."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, DeepseekV2Config

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.entrypoints.bench.moe_floor import AttentionShape, MoeShape, kv_bytes_per_token, moe_floor
from pagedllm.entrypoints.bench.throughput import MOE_MODEL_TYPES
from pagedllm.entrypoints.bench.workloads import CONFIG_DIR, WORKLOADS
from pagedllm.models import get_model_class


def _meta_params(config) -> dict[str, int]:
    with torch.device("meta"):
        model = get_model_class(config.architectures)(config, TorchAttentionBackend)
    return {name: p.numel() for name, p in model.named_parameters()}


def _tiny_deepseek(q_lora_rank: int | None) -> DeepseekV2Config:
    return DeepseekV2Config(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=12,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        topk_method="greedy",
        architectures=["DeepseekV2ForCausalLM"],
    )


def test_w7_is_deepseek_v2_lite_on_w1s_requests() -> None:
    workload = WORKLOADS["W7"]
    assert (workload.num_prompts, workload.input_len, workload.output_len) == (256, (100, 1024), 256)
    assert workload.prompts() == WORKLOADS["W1"].prompts()
    config = AutoConfig.from_pretrained(workload.model)
    assert config.model_type in MOE_MODEL_TYPES
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.n_shared_experts) == (512, 64, 2)
    assert 15.6e9 < sum(_meta_params(config).values()) < 15.8e9  # "15.7B total"


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_a_step_touching_every_expert_reads_every_matrix(q_lora_rank: int | None) -> None:
    """Shared experts read every step, routed ones as touched; MLA's projections with and
    without q_lora: our model's parameters, counted on the meta device."""
    config = _tiny_deepseek(q_lora_rank)
    shape = MoeShape.from_config(config)
    params = _meta_params(config)
    matrices = sum(n for name, n in params.items() if "norm" not in name and "embed_tokens" not in name)
    routed = sum(n for name, n in params.items() if ".experts." in name)
    assert routed == 2 * 8 * shape.expert_params  # two sparse layers of 8 (shared ones not among them)
    assert shape.decode_step_params(10_000) == pytest.approx(matrices)
    assert shape.decode_step_params(1) == pytest.approx(matrices - routed * (1 - 2 / 8))
    lm_head = config.vocab_size * config.hidden_size
    assert shape.active_params_per_token == pytest.approx(matrices - lm_head - routed * (1 - 2 / 8))


def test_kv_bytes_per_token_beside_llama() -> None:
    """V2-Lite's latent (512 + 64 per layer, 27 layers) against Llama-3.1-8B's K and V (8 KV heads
    of 128, 32 layers), bf16; the same figure the engine's cache spec gives a block, per token."""
    from pagedllm.config import ModelConfig
    from pagedllm.worker.cache_engine import KVCacheSpec

    v2_lite = AutoConfig.from_pretrained(WORKLOADS["W7"].model)
    llama = AutoConfig.from_pretrained(f"{CONFIG_DIR}/llama-3.1-8b")
    assert kv_bytes_per_token(llama, 2) == 131_072
    assert kv_bytes_per_token(v2_lite, 2) == 27 * 576 * 2 == 31_104
    model_config = ModelConfig(WORKLOADS["W7"].model, WORKLOADS["W7"].model, v2_lite, torch.bfloat16, 1280)
    spec = KVCacheSpec(
        num_layers=v2_lite.num_hidden_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_size=model_config.head_size,
        block_size=16,
        dtype=torch.bfloat16,
        keys_only=model_config.is_mla,
    )
    assert spec.block_bytes == 16 * kv_bytes_per_token(v2_lite, 2)


def test_mla_attention_shape() -> None:
    """The attention's prefill FLOPs per (query, key) pair: q.k over qk_nope + rope dims and p.v
    over v_head_dim, each a multiply-add per head."""
    attention = AttentionShape.from_config(_tiny_deepseek(None))
    assert (attention.kv_elements, attention.flops_per_pair) == (16 + 4, 2 * 4 * (8 + 4 + 12))


def test_floor_of_one_mla_request() -> None:
    config = _tiny_deepseek(None)
    shape = MoeShape.from_config(config)
    floor = moe_floor(
        shape, [10], output_len=4, max_num_seqs=8, element_size=2, bandwidth=1e9, peak_flops=1e12
    )
    # Three decode steps, contexts 11, 12, 13; one latent of 16 + 4 per token in each of 3 layers.
    assert floor["kv_tb"] * 1e12 == (11 + 12 + 13) * 3 * 20 * 2
    attention = 3 * 2 * 4 * (12 + 12) * 10 * 11 // 2
    assert floor["prefill_tflop"] * 1e12 == 2 * shape.active_params_per_token * 10 + attention + 2 * 100 * 32
