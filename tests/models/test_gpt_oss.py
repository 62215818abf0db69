"""gpt-oss's MXFP4 expert weights: the dequantization against transformers' own
(``integrations.mxfp4.convert_moe_packed_tensors``) and the OCP MX spec's definition, a checkpoint
shipped in MXFP4 loaded and run against Hugging Face (float32, CPU, through a paged cache), and
the errors for tensors that do not fit. Greedy generation on every backend is in
tests/models/test_families.py."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.layers.quantization.mxfp4 import dequantize_mxfp4
from pagedllm.model_loader import get_model

TINY_GPT_OSS = dict(
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention"],
    swiglu_limit=0.5,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [*shape, 16], scales [*shape]) uint8; exponents 2^-6..2^-2 keep activations tame."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(121, 126, shape, generator=generator, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("chunk_blocks", [7, 1 << 18])  # chunks that split rows, and one chunk
def test_dequantize_matches_transformers(chunk_blocks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pagedllm.layers.quantization.mxfp4._CHUNK_BLOCKS", chunk_blocks)
    blocks, scales = _random_mxfp4((3, 8, 4), seed=0)  # [experts, rows, column blocks]
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [3, 8, 128]
    # transformers returns the weight transposed, as its experts multiply x @ W.
    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    torch.testing.assert_close(ours, reference.transpose(1, 2), atol=0, rtol=0)


def test_dequantize_follows_the_spec() -> None:
    """Byte 0x9F: low nibble 0xF (-6.0) first, high nibble 0x9 (-0.5); byte 0x21: 0.5, 1.0; shared
    exponent 2^(128 - 127) = 2. The other 28 elements are code 0 (+0.0)."""
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0], blocks[0, 1] = 0x9F, 0x21
    out = dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8), torch.float32)
    assert out.shape == (32,)
    assert out[:4].tolist() == [-12.0, -1.0, 1.0, 2.0]
    assert out[4:].abs().sum() == 0


@pytest.mark.parametrize(
    "blocks, scales, match",
    [
        (
            torch.zeros(2, 4, 8, dtype=torch.uint8),
            torch.zeros(2, 4, dtype=torch.uint8),
            r"\[\.\.\., num_blocks, 16\]",
        ),
        (
            torch.zeros(2, 4, 16, dtype=torch.uint8),
            torch.zeros(2, 3, dtype=torch.uint8),
            r"\(2, 3\) do not fit",
        ),
        (torch.zeros(2, 4, 16), torch.zeros(2, 4, dtype=torch.uint8), "must be uint8"),
    ],
)
def test_tensors_that_do_not_fit_are_refused(blocks: torch.Tensor, scales: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dequantize_mxfp4(blocks, scales, torch.float32)


def _ship_experts_in_mxfp4(hf_model: torch.nn.Module, model_dir: Path) -> None:
    """Give every layer's experts random MXFP4 weights: the HF model gets transformers'
    dequantization of them, the checkpoint the blocks and scales, as gpt-oss ships."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for i, layer in enumerate(hf_model.model.layers):
        experts = layer.mlp.experts
        num_experts, hidden, two_i = experts.gate_up_proj.shape
        prefix = f"model.layers.{i}.mlp.experts"
        for name, rows, cols in (("gate_up_proj", two_i, hidden), ("down_proj", hidden, two_i // 2)):
            blocks, scales = _random_mxfp4((num_experts, rows, cols // 32), seed=10 * i + len(name))
            with torch.no_grad():
                getattr(experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            del tensors[f"{prefix}.{name}"]
            tensors[f"{prefix}.{name}_blocks"], tensors[f"{prefix}.{name}_scales"] = blocks, scales
    save_file(tensors, path, metadata={"format": "pt"})


def test_mxfp4_checkpoint_matches_hf(
    make_tiny_model: Callable, prefill_then_decode_match_hf: Callable, caplog: pytest.LogCaptureFixture
) -> None:
    hf_model, model_config = make_tiny_model(GptOssConfig, **TINY_GPT_OSS)
    _ship_experts_in_mxfp4(hf_model, Path(model_config.model))
    with caplog.at_level(logging.WARNING, logger="pagedllm.models.gpt_oss"):
        model = get_model(model_config, "auto", torch.device("cpu"), TorchAttentionBackend)
    assert "MXFP4 expert weights dequantized to torch.float32" in caplog.text
    assert "GiB instead of" in caplog.text
    prefill_then_decode_match_hf(hf_model, model_config, model, atol=1e-4)


def test_mxfp4_blocks_without_scales_are_refused(make_tiny_model: Callable) -> None:
    hf_model, model_config = make_tiny_model(GptOssConfig, **TINY_GPT_OSS)
    _ship_experts_in_mxfp4(hf_model, Path(model_config.model))
    path = Path(model_config.model) / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.down_proj has _blocks only"):
        get_model(model_config, "auto", torch.device("cpu"), TorchAttentionBackend)


def test_mxfp4_scales_of_the_wrong_shape_are_refused(make_tiny_model: Callable) -> None:
    hf_model, model_config = make_tiny_model(GptOssConfig, **TINY_GPT_OSS)
    _ship_experts_in_mxfp4(hf_model, Path(model_config.model))
    path = Path(model_config.model) / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"cannot load MXFP4 checkpoint weight model.layers.0.mlp.experts.gate_up_proj"
    ):
        get_model(model_config, "auto", torch.device("cpu"), TorchAttentionBackend)
