"""The W3 floor's weight bytes per decode token (entrypoints/bench/weight_read.py) against a count
by hand from the config: dense, online FP8 (the GPU's stored form forced on the CPU), tied heads,
and a W4A16 layer's packed words, scales and zeros."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from pagedllm.attention.backends.cpu_backend import CpuAttentionBackend
from pagedllm.entrypoints.bench.weight_read import decode_weight_bytes
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.quantization import fp8 as fp8_module
from pagedllm.layers.quantization.fp8 import Fp8Kernel
from pagedllm.layers.quantization.wna16 import IntWeightMethod, IntWeightScheme, PackQuantizedMethod
from pagedllm.model_loader import get_model


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


def test_a_w4a16_layer_counts_half_a_byte_per_weight_and_its_groups(monkeypatch) -> None:
    n, k, group = 32, 256, 64
    monkeypatch.setattr(IntWeightMethod, "kernel_fits", lambda *args: True)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = ReplicatedLinear(k, n, bias=False)
        method = PackQuantizedMethod(IntWeightScheme(4, group), per_channel=False)
        method.create_weights(layer)
        layer.quant_method = method
        for name, param in layer.named_parameters():
            param.data.zero_() if name != "weight_scale" else param.data.fill_(0.01)
        layer.weight_shape.data.copy_(torch.tensor([[n, k]]))
        method.process_weights_after_loading(layer)
    finally:
        torch.set_default_dtype(previous)
    model = nn.Sequential(layer)
    # 4 bits per weight, then a bf16 scale and a bf16 zero per group of 64 inputs of a row.
    assert decode_weight_bytes(model) == n * k // 2 + 2 * 2 * n * (k // group)
