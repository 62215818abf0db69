"""GGUF Q4 products at prefill sizes: the weight dequantized a tile at a time into bf16 GEMMs
gives the values the gguf package's own dequantization gives (to bf16 rounding), and only rows
from DEQUANTIZE_MIN_ROWS up take that path (decode keeps the int4 kernels)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.layers.quantization import gguf as gguf_q4

TYPES = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1}


def _quantized(tensor_type: str, num_outputs: int, input_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw GGUF blocks uint8 [N, row_bytes], their float32 dequantization by the gguf package)."""
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((num_outputs, input_size)) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(weight, TYPES[tensor_type])
    return torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, TYPES[tensor_type]))


@pytest.mark.parametrize("tensor_type", TYPES)
def test_a_dequantized_tile_is_the_gguf_packages_weight_to_bf16_rounding(tensor_type: str):
    raw, oracle = _quantized(tensor_type, 320, 96)
    packed, scales_and_zeros = gguf_q4.pack_q4(raw, tensor_type)
    for start, end in ((0, 320), (64, 192)):
        tile = gguf_q4.dequantize_packed(packed, scales_and_zeros, start, end)
        assert tile.dtype == torch.bfloat16 and tile.shape == (end - start, 96)
        # Scales and zeros are bf16 in the packing, and the tile is rounded to bf16 once more.
        torch.testing.assert_close(tile.float(), oracle[start:end], rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("tensor_type", TYPES)
@pytest.mark.parametrize("num_rows", [1, 40, 200])
def test_q4_matmul_agrees_with_the_dequantized_oracle_at_every_size(
    tensor_type: str, num_rows: int, monkeypatch
):
    # A small tile, so that several tiles (and a last, shorter one) make up the product.
    monkeypatch.setattr(gguf_q4, "DEQUANTIZE_TILE_VALUES", 128 * 96)
    raw, oracle = _quantized(tensor_type, 320, 96)
    packed, scales_and_zeros = gguf_q4.pack_q4(raw, tensor_type)
    x = torch.randn(num_rows, 96)
    expected = x.bfloat16().float() @ oracle.t()
    calls = []
    real = gguf_q4.dequantized_matmul
    monkeypatch.setattr(
        gguf_q4, "dequantized_matmul", lambda x, *args: calls.append(x.shape[0]) or real(x, *args)
    )
    out = gguf_q4.q4_matmul(x, packed, scales_and_zeros)
    assert out.dtype == torch.float32 and out.shape == (num_rows, 320)
    assert bool(calls) == (num_rows >= gguf_q4.DEQUANTIZE_MIN_ROWS)
    assert calls in ([], [208])  # 200 rows padded to their bucket (row_buckets), for oneDNN's GEMM
    error = (out - expected).norm() / expected.norm()
    assert error < 1e-2, error


@pytest.mark.parametrize("tensor_type", TYPES)
def test_the_cpu_kernels_dequantization_is_the_torch_formulations(tensor_type: str):
    from pagedllm.kernels.cpu import ops as cpu_ops
    from pagedllm.kernels.cpu.build import available

    if not available():
        pytest.skip("the CPU kernels do not build here")
    raw, oracle = _quantized(tensor_type, 320, 96)
    packed, scales_and_zeros = gguf_q4.pack_q4(raw, tensor_type)
    for start, end in ((0, 320), (128, 256)):
        kernel = cpu_ops.int4_dequantize(packed, scales_and_zeros, start, end)
        reference = gguf_q4.dequantize_packed(packed, scales_and_zeros, start, end)
        # Each rounds q * scale + offset once to bf16 (the offset's float32 rounding may differ).
        torch.testing.assert_close(kernel.float(), reference.float(), rtol=8e-3, atol=1e-6)
        torch.testing.assert_close(kernel.float(), oracle[start:end], rtol=2e-2, atol=2e-3)
