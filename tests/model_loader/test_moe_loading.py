"""Loading mixture-of-experts checkpoints: per-expert tensors stacked, already stacked tensors,
dummy weights, and the errors for checkpoints that do not fit the config."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, Qwen3MoeConfig

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.model_loader import get_model

CPU = torch.device("cpu")
QWEN3_MOE = dict(
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)
MIXTRAL = dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)


def _get_model(model_config: ModelConfig, load_format: str = "auto") -> torch.nn.Module:
    return get_model(model_config, load_format, CPU, TorchAttentionBackend)


def _edit_checkpoint(model_dir: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = Path(model_dir) / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _with_config(model_config: ModelConfig, **changes: object) -> ModelConfig:
    hf_config = copy.deepcopy(model_config.hf_config)
    for name, value in changes.items():
        setattr(hf_config, name, value)  # through the config's aliases (num_experts -> num_local_experts)
    return dataclasses.replace(model_config, hf_config=hf_config)


def test_per_expert_tensors_are_stacked_in_expert_order(make_tiny_model: Callable) -> None:
    hf_model, model_config = make_tiny_model(MixtralConfig, **MIXTRAL)
    experts = _get_model(model_config).model.layers[1].mlp.experts
    hf_experts = hf_model.model.layers[1].mlp.experts  # transformers' own stacked layout
    assert torch.equal(experts.gate_up_proj, hf_experts.gate_up_proj)
    assert torch.equal(experts.down_proj, hf_experts.down_proj)


def test_stacked_checkpoint_tensors_load_whole(
    make_tiny_model: Callable, paged_runner: type, reference_logits: Callable
) -> None:
    hf_model, model_config = make_tiny_model(Qwen3MoeConfig, **QWEN3_MOE)

    def stack(tensors: dict[str, torch.Tensor]) -> None:
        for layer in range(2):
            prefix = f"model.layers.{layer}.mlp.experts"
            per_expert = {
                proj: [tensors.pop(f"{prefix}.{e}.{proj}.weight") for e in range(4)]
                for proj in ("gate_proj", "up_proj", "down_proj")
            }
            gate_up = [torch.cat(pair) for pair in zip(per_expert["gate_proj"], per_expert["up_proj"])]
            tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
            tensors[f"{prefix}.down_proj"] = torch.stack(per_expert["down_proj"])

    _edit_checkpoint(model_config.model, stack)
    prompt = list(range(5, 16))
    logits = paged_runner(_get_model(model_config), model_config).step({0: prompt})[0]
    torch.testing.assert_close(logits, reference_logits(hf_model, prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "config_class,overrides,absent",
    [
        (Qwen3MoeConfig, QWEN3_MOE, "model.layers.1.mlp.experts.2.up_proj.weight"),
        (MixtralConfig, MIXTRAL, "model.layers.0.block_sparse_moe.experts.3.w2.weight"),
    ],
)
def test_missing_expert_tensor_is_named(make_tiny_model: Callable, config_class, overrides, absent) -> None:
    _, model_config = make_tiny_model(config_class, **overrides)
    _edit_checkpoint(model_config.model, lambda tensors: tensors.pop(absent))
    with pytest.raises(ValueError, match="the checkpoint has no weights for") as excinfo:
        _get_model(model_config)
    assert f"absent: {absent})" in str(excinfo.value)


def test_checkpoint_with_more_experts_than_the_config(make_tiny_model: Callable) -> None:
    _, model_config = make_tiny_model(Qwen3MoeConfig, **QWEN3_MOE)
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.mlp\.experts\.2\.down_proj\.weight': expert 2 is out of range.*=2",
    ):
        _get_model(_with_config(model_config, num_experts=2, num_experts_per_tok=1))


def test_checkpoint_with_fewer_experts_than_the_config(make_tiny_model: Callable) -> None:
    _, model_config = make_tiny_model(MixtralConfig, **MIXTRAL)
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.block_sparse_moe\.gate\.weight'.*shape mismatch"
    ):
        _get_model(_with_config(model_config, num_local_experts=6))


@pytest.mark.parametrize("top_k", [0, 5])
def test_top_k_outside_the_experts_is_refused_before_loading(make_tiny_model: Callable, top_k: int) -> None:
    _, model_config = make_tiny_model(Qwen3MoeConfig, **QWEN3_MOE)
    with pytest.raises(
        ValueError, match=rf"num_experts_per_tok must be in \[1, num_experts=4\], got {top_k}"
    ):
        _get_model(_with_config(model_config, num_experts_per_tok=top_k))


def test_dummy_moe_weights(paged_runner: type) -> None:
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        **QWEN3_MOE,
        architectures=["Qwen3MoeForCausalLM"],
        initializer_range=0.05,
    )
    model_config = ModelConfig(
        model="dummy", tokenizer="dummy", hf_config=config, dtype=torch.float32, max_model_len=64
    )
    model = _get_model(model_config, "dummy")
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 64, 64) and experts.down_proj.shape == (4, 64, 32)
    assert abs(experts.gate_up_proj.std().item() - 0.05) < 0.01
    logits = paged_runner(model, model_config).step({0: [1, 2, 3]})[0]
    assert torch.isfinite(logits).all()
