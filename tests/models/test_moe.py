"""Qwen3-MoE and Mixtral against Hugging Face transformers, in float32 on the CPU, through a paged
cache: expert counts, top-k 1/2/8, renormalised or not, sparse and dense layer layouts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import MixtralConfig, PreTrainedModel, Qwen3MoeConfig

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.model_loader import get_model
from pagedllm.models import MixtralForCausalLM, Qwen3MoeForCausalLM, get_model_class
from pagedllm.models.llama import LlamaMLP
from pagedllm.models.moe import SparseMoeBlock

ATOL = 1e-4

QWEN3_MOE = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=32)
MIXTRAL = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=48)

# (config class, overrides).
CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "qwen3moe-e4-top1": (Qwen3MoeConfig, dict(QWEN3_MOE, num_experts=4, num_experts_per_tok=1)),
    "qwen3moe-e8-top2-norm": (
        Qwen3MoeConfig,
        dict(QWEN3_MOE, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    ),
    "qwen3moe-e16-top8-tied": (
        Qwen3MoeConfig,
        dict(QWEN3_MOE, num_experts=16, num_experts_per_tok=8, tie_word_embeddings=True),
    ),
    # Layers 0 and 2 dense (mlp_only_layers, then decoder_sparse_step=2 skips layer 2), 1 and 3 sparse.
    "qwen3moe-mixed-layers": (
        Qwen3MoeConfig,
        dict(
            QWEN3_MOE,
            num_hidden_layers=4,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            mlp_only_layers=[0],
        ),
    ),
    "mixtral-e4-top2": (MixtralConfig, dict(MIXTRAL, num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-e8-top1": (MixtralConfig, dict(MIXTRAL, num_local_experts=8, num_experts_per_tok=1)),
    "mixtral-e8-top8": (MixtralConfig, dict(MIXTRAL, num_local_experts=8, num_experts_per_tok=8)),
}


@pytest.fixture
def load_case(make_tiny_model: Callable) -> Callable[[str], tuple[PreTrainedModel, ModelConfig, Any]]:
    def load(case: str) -> tuple[PreTrainedModel, ModelConfig, Any]:
        config_class, overrides = CASES[case]
        hf_model, model_config = make_tiny_model(config_class, **overrides)
        model = get_model(model_config, "auto", torch.device("cpu"), TorchAttentionBackend)
        return hf_model, model_config, model

    return load


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_then_decode_matches_hf(
    case: str, load_case: Callable, prefill_then_decode_match_hf: Callable
) -> None:
    prefill_then_decode_match_hf(*load_case(case), atol=ATOL)


def test_sparse_and_dense_layers_follow_the_config(load_case: Callable) -> None:
    hf_model, _, model = load_case("qwen3moe-mixed-layers")
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [LlamaMLP, SparseMoeBlock, LlamaMLP, SparseMoeBlock]
    hf_kinds = [type(layer.mlp).__name__ for layer in hf_model.model.layers]
    assert hf_kinds == ["Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]


def test_registry() -> None:
    assert get_model_class(["Qwen3MoeForCausalLM"]) is Qwen3MoeForCausalLM
    assert get_model_class(["MixtralForCausalLM"]) is MixtralForCausalLM
