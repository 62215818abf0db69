"""The W3 floor's weight bytes per decode token (entrypoints/bench/weight_read.py) against a count
by hand from the config: dense, online FP8 (the GPU's stored form forced on the CPU), tied heads,
and the W4A16 benchmark config's packed words, scales and zeros."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaConfig

from pagedllm.attention.backends.cpu_backend import CpuAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.entrypoints.bench.weight_read import decode_weight_bytes
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization import fp8 as fp8_module
from pagedllm.layers.quantization.fp8 import Fp8Kernel
from pagedllm.layers.quantization.wna16 import IntWeightMethod, PackQuantizedMethod
from pagedllm.model_loader import get_model

W4A16_CONFIG = Path(__file__).parents[2] / "benchmarks" / "configs" / "llama-3.1-8b-w4a16" / "config.json"


def _linear_shapes(config: LlamaConfig) -> list[tuple[int, int]]:
    """[N, K] of one decoder layer's projections, fused as the model holds them."""
    h, i, d = config.hidden_size, config.intermediate_size, config.hidden_size // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * d
    return [(qkv, h), (h, config.num_attention_heads * d), (2 * i, h), (h, i)]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_a_decode_token_reads_the_linears_at_their_format_one_embedding_row_and_the_whole_head(
    make_tiny_model, monkeypatch, tied: bool, fp8: bool
) -> None:
    _, model_config = make_tiny_model(
        LlamaConfig, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied
    )
    config = model_config.hf_config
    if fp8:  # the CUDA layout (e4m3 [K, N] view, float32 scale per output row), forced on the CPU
        monkeypatch.setattr(fp8_module, "choose_kernel", lambda *args: Fp8Kernel.SCALED_MM)
        model_config = dataclasses.replace(model_config, quantization="fp8")
    model = get_model(model_config, "dummy", torch.device("cpu"), CpuAttentionBackend)
    h, vocab, f32 = config.hidden_size, config.vocab_size, 4
    per_linear = (lambda n, k: n * k + f32 * n) if fp8 else (lambda n, k: f32 * n * k)
    layer = sum(per_linear(n, k) for n, k in _linear_shapes(config)) + 2 * f32 * h  # + two norms
    expected = config.num_hidden_layers * layer + f32 * h  # final norm
    expected += f32 * vocab * h + f32 * h  # the head's table, whole; the embedding's row
    assert decode_weight_bytes(model) == expected


def test_the_benchmark_w4a16_config_loads_dummy_weights_read_at_half_a_byte(tmp_path, monkeypatch) -> None:
    """benchmarks/configs/llama-3.1-8b-w4a16 (W3 with W4A16) shrunk to one tiny layer: its
    compressed-tensors quantization_config takes every linear but the head, dummy weights load,
    and a token reads 4 bits per weight plus a bf16 scale and zero per group of 128 inputs."""
    config = json.loads(W4A16_CONFIG.read_text())
    h, i, heads, kv, d, vocab = 256, 512, 2, 1, 128, 384
    config.update(hidden_size=h, intermediate_size=i, num_attention_heads=heads, num_key_value_heads=kv)
    config.update(head_dim=d, vocab_size=vocab, num_hidden_layers=1, torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_config = AutoConfig.from_pretrained(tmp_path)
    model_config = ModelConfig(str(tmp_path), str(tmp_path), hf_config, torch.bfloat16, 128)
    monkeypatch.setattr(IntWeightMethod, "kernel_fits", lambda *args: True)  # the CUDA layout
    model = get_model(model_config, "dummy", torch.device("cpu"), CpuAttentionBackend)
    assert all(isinstance(m.quant_method, PackQuantizedMethod) for m in model.model.layers[0].modules()
               if isinstance(m, LinearBase))  # fmt: skip
    group, bf16 = 128, 2
    shapes = [((heads + 2 * kv) * d, h), (h, heads * d), (2 * i, h), (h, i)]
    linears = sum(n * k // 2 + 2 * bf16 * n * (k // group) for n, k in shapes)
    expected = linears + 3 * bf16 * h + bf16 * vocab * h + bf16 * h  # norms, head, embedding row
    assert decode_weight_bytes(model) == expected
