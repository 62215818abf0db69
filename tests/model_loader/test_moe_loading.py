"""Loading mixture-of-experts checkpoints: per-expert tensors stacked, already stacked tensors,
dummy weights, and the errors for checkpoints that do not fit the config."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, PreTrainedModel, Qwen3MoeConfig

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.model_loader import get_model
from pagedllm.model_loader.gguf_loader import load_gguf_config

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


# --- GGUF -----------------------------------------------------------------------------------


def _write_gguf(hf_model: PreTrainedModel, architecture: str, path: Path) -> None:
    """The HF model as llama.cpp's converter lays it out: names from gguf's own map, each expert
    projection stacked [num_experts, ...], q/k rows permuted for "llama" files, float32."""
    config = hf_model.config
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture)
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if hasattr(config, "moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    for name, tensor in hf_model.state_dict().items():
        module, _, suffix = name.rpartition(".")
        if name.endswith(".experts.gate_up_proj"):  # transformers' [E, 2I, H]: GGUF stores gate and up apart
            pieces = dict(zip(("gate_proj", "up_proj"), tensor.chunk(2, dim=1)))
        elif name.endswith(".experts.down_proj"):
            pieces = {"down_proj": tensor}
        else:
            pieces = None
        if pieces is not None:
            for projection, piece in pieces.items():
                gguf_name = name_map.get_name(f"{name.rpartition('.')[0]}.{projection}")
                writer.add_tensor(f"{gguf_name}.weight", piece.contiguous().numpy())
            continue
        if architecture == "llama" and module.endswith(("q_proj", "k_proj")):
            num_heads = (
                config.num_attention_heads if module.endswith("q_proj") else config.num_key_value_heads
            )
            # llama.cpp's permute: each head's rotary halves interleaved.
            tensor = tensor.reshape(num_heads, 2, -1, tensor.shape[-1]).transpose(1, 2).reshape(tensor.shape)
        writer.add_tensor(f"{name_map.get_name(module)}.{suffix}", tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    "config_class,overrides,architecture,hf_architecture",
    [
        (Qwen3MoeConfig, dict(QWEN3_MOE, norm_topk_prob=True), "qwen3moe", "Qwen3MoeForCausalLM"),
        (MixtralConfig, dict(MIXTRAL, head_dim=16), "llama", "MixtralForCausalLM"),
    ],
)
def test_gguf_moe_matches_hf(
    make_tiny_model: Callable,
    paged_runner: type,
    reference_logits: Callable,
    tmp_path: Path,
    config_class,
    overrides,
    architecture: str,
    hf_architecture: str,
) -> None:
    hf_model, _ = make_tiny_model(config_class, **overrides)
    path = tmp_path / "tiny-moe.gguf"
    _write_gguf(hf_model, architecture, path)
    config = load_gguf_config(str(path))
    assert config.architectures == [hf_architecture]
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    model_config = ModelConfig(
        model=str(path),
        tokenizer=str(path),
        hf_config=config,
        dtype=torch.float32,
        max_model_len=64,
        gguf_file=str(path),
    )
    prompt = list(range(7, 19))
    logits = paged_runner(_get_model(model_config), model_config).step({0: prompt})[0]
    torch.testing.assert_close(logits, reference_logits(hf_model, prompt), atol=1e-4, rtol=0)


def test_experts_other_than_swiglu_are_refused(make_tiny_model: Callable) -> None:
    _, model_config = make_tiny_model(MixtralConfig, **MIXTRAL)
    with pytest.raises(ValueError, match=r"hidden_act must be 'silu' for the experts.*'gelu'"):
        _get_model(_with_config(model_config, hidden_act="gelu"))
