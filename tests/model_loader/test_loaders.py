"""Loading weights: HF safetensors directories, GGUF files, dummy weights, and the errors of each."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, PretrainedConfig, PreTrainedModel

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.model_loader import get_model
from pagedllm.model_loader.gguf_loader import _undo_rope_permute, load_gguf_config

CPU = torch.device("cpu")
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_LLAMA = dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True)


@pytest.fixture
def tiny_llama(make_tiny_model: Callable) -> tuple[PreTrainedModel, ModelConfig]:
    return make_tiny_model(LlamaConfig, **TINY_LLAMA)


def _get_model(model_config: ModelConfig, load_format: str = "auto") -> torch.nn.Module:
    return get_model(model_config, load_format, CPU, TorchAttentionBackend)


def _rewrite_checkpoint(model_dir: Path, edit: dict[str, torch.Tensor | None]) -> None:
    """Set (or, for None, delete) tensors of the directory's single safetensors file."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name, tensor in edit.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    save_file(tensors, path)


# --- HF directories -------------------------------------------------------------------------


def test_sharded_safetensors_directory(
    tiny_llama: tuple, tmp_path: Path, paged_runner: type, reference_logits: Callable
) -> None:
    hf_model, model_config = tiny_llama
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    sharded_config = dataclasses.replace(model_config, model=str(tmp_path / "sharded"))
    prompt = list(range(3, 14))
    logits = paged_runner(_get_model(sharded_config), sharded_config).step({0: prompt})[0]
    torch.testing.assert_close(logits, reference_logits(hf_model, prompt), atol=1e-4, rtol=0)


def test_pickle_only_directory_is_refused(tiny_llama: tuple) -> None:
    _, model_config = tiny_llama
    model_dir = Path(model_config.model)
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*refused.*convert them to safetensors"):
        _get_model(model_config)


def test_missing_weight_is_named(tiny_llama: tuple) -> None:
    _, model_config = tiny_llama
    _rewrite_checkpoint(
        Path(model_config.model), {"model.layers.1.self_attn.k_proj.bias": None, "model.norm.weight": None}
    )
    with pytest.raises(ValueError, match="the checkpoint has no weights for") as excinfo:
        _get_model(model_config)
    assert "model.layers.1.self_attn.qkv_proj.bias (from k_proj)" in str(excinfo.value)
    assert "model.norm.weight" in str(excinfo.value)


def test_unexpected_or_misshapen_weight_is_named(tiny_llama: tuple) -> None:
    _, model_config = tiny_llama
    model_dir = Path(model_config.model)
    _rewrite_checkpoint(model_dir, {"model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.extra_proj\.weight' matches no parameter"):
        _get_model(model_config)
    _rewrite_checkpoint(
        model_dir, {"model.layers.0.mlp.extra_proj.weight": None, "model.norm.weight": torch.ones(65)}
    )
    with pytest.raises(ValueError, match=r"'model\.norm\.weight'.*shape mismatch"):
        _get_model(model_config)


def test_unknown_load_format(tiny_llama: tuple) -> None:
    _, model_config = tiny_llama
    with pytest.raises(ValueError, match="load_format must be"):
        _get_model(model_config, "pt")


# --- dummy weights --------------------------------------------------------------------------


def _dummy_config(dtype: torch.dtype) -> ModelConfig:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        initializer_range=0.05,
        architectures=["LlamaForCausalLM"],
    )
    return ModelConfig(model="dummy", tokenizer="dummy", hf_config=config, dtype=dtype, max_model_len=64)


def test_dummy_weights_are_deterministic_and_shaped_like_an_init(paged_runner: type) -> None:
    model_config = _dummy_config(torch.float32)
    torch.manual_seed(1)
    first = _get_model(model_config, "dummy")
    torch.manual_seed(1)
    second = _get_model(model_config, "dummy")
    for (name, param), other in zip(first.named_parameters(), second.parameters()):
        assert torch.equal(param, other), name
    for module in first.modules():
        if isinstance(module, RMSNorm):
            assert torch.all(module.weight == 1)
    qkv = first.model.layers[0].self_attn.qkv_proj
    assert torch.all(qkv.bias == 0)
    assert abs(qkv.weight.std().item() - 0.05) < 0.01
    logits = paged_runner(first, model_config).step({0: [1, 2, 3]})[0]
    assert torch.isfinite(logits).all()


def test_dummy_model_is_built_in_the_run_dtype() -> None:
    model = _get_model(_dummy_config(torch.bfloat16), "dummy")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.bfloat16
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert torch.get_default_dtype() == torch.float32


# --- GGUF -----------------------------------------------------------------------------------


def _llama_cpp_permute(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj/k_proj of the llama architecture."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def test_rope_permute_is_undone() -> None:
    config = PretrainedConfig(num_attention_heads=6, num_key_value_heads=2, head_dim=8)
    q, k, k_bias = torch.randn(6 * 8, 16), torch.randn(2 * 8, 16), torch.randn(2 * 8)
    prefix = "model.layers.0.self_attn."
    for name, weight, num_heads in (
        ("q_proj.weight", q, 6),
        ("k_proj.weight", k, 2),
        ("k_proj.bias", k_bias, 2),
    ):
        permuted = _llama_cpp_permute(weight, num_heads)
        assert torch.equal(_undo_rope_permute(prefix + name, permuted, config), weight)
    assert torch.equal(_undo_rope_permute(prefix + "v_proj.weight", k, config), k)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ValueError, match=r"GGUF architecture 'gpt2' is not supported; supported: \['llama', 'qwen2'"
    ):
        load_gguf_config(str(path))


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_dequantization(
    smollm2_gguf: str, smollm2_hf_model: PreTrainedModel, paged_runner: type, reference_logits: Callable
) -> None:
    config = load_gguf_config(smollm2_gguf)
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    model_config = ModelConfig(
        model=smollm2_gguf,
        tokenizer=smollm2_gguf,
        hf_config=config,
        dtype=torch.float32,
        max_model_len=256,
        gguf_file=smollm2_gguf,
    )
    model = _get_model(model_config)
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30]  # arbitrary token ids
    logits = paged_runner(model, model_config).step({0: prompt})[0]
    expected = reference_logits(smollm2_hf_model, prompt)
    torch.testing.assert_close(logits, expected, atol=1e-3 * expected.abs().max().item(), rtol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_gguf_config_matches_transformers_conversion(smollm2_gguf: str, tmp_path, monkeypatch) -> None:
    from transformers import AutoConfig

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))  # derived here, not read from a cache
    ours = load_gguf_config(smollm2_gguf).to_dict()
    directory, name = os.path.split(smollm2_gguf)
    theirs = AutoConfig.from_pretrained(directory, gguf_file=name).to_dict()
    for key in ("_name_or_path", "_model_name_or_path", "architectures", "unk_token_id"):
        ours.pop(key, None)
        theirs.pop(key, None)
    assert ours == theirs
