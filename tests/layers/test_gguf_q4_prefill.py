"""GGUF Q4 products at prefill sizes: the weight decoded a tile at a time into bf16 GEMMs gives
the values the gguf package's own dequantization gives (to bf16 rounding), through either tiled
product (the brgemm kernel on AMX, torch.mm on row-major tiles elsewhere, with or without the C++
kernels), and only rows from the product's threshold up take it (decode keeps the int4 kernels)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.build import available as cpu_kernels_available
from pagedllm.layers.quantization import gguf as gguf_q4

TYPES = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1}


def _quantized(tensor_type: str, num_outputs: int, input_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw GGUF blocks uint8 [N, row_bytes], their float32 dequantization by the gguf package)."""
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((num_outputs, input_size)) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(weight, TYPES[tensor_type])
    return torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, TYPES[tensor_type]))


def _random_packed(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pack_q4-layout weight of random nibbles, scales and zeros: (packed, scales_and_zeros)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    return packed, (torch.randn(k // 32, n, 2, generator=gen) * 0.05).bfloat16()


def _brgemm_or_skip() -> None:
    if not (cpu_kernels_available() and cpu_ops.int4_prefill_supported()):
        pytest.skip("the brgemm kernel needs the CPU kernels and AMX bf16")


@pytest.mark.parametrize("tensor_type", TYPES)
def test_a_dequantized_tile_is_the_gguf_packages_weight_to_bf16_rounding(tensor_type: str):
    raw, oracle = _quantized(tensor_type, 320, 96)
    packed, scales_and_zeros = gguf_q4.pack_q4(raw, tensor_type)
    for start, end in ((0, 320), (64, 192)):
        tile = gguf_q4.dequantize_packed(packed, scales_and_zeros, start, end)
        assert tile.dtype == torch.bfloat16 and tile.shape == (end - start, 96)
        # Scales and zeros are bf16 in the packing, and the tile is rounded to bf16 once more.
        torch.testing.assert_close(tile.float(), oracle[start:end], rtol=2e-2, atol=2e-3)


def _tiled_product(name: str, monkeypatch: pytest.MonkeyPatch) -> gguf_q4.TiledProduct:
    """The product ``tiled_product()`` would choose on a machine of that kind."""
    if name == "brgemm":
        _brgemm_or_skip()
        return gguf_q4.TiledProduct(cpu_ops.int4_prefill_matmul, gguf_q4.BRGEMM_MIN_ROWS)
    if name == "torch_mm_without_cpu_kernels":
        monkeypatch.setattr(gguf_q4, "cpu_kernels_available", lambda: False)
    # A small tile, so that several tiles (and a last, shorter one) make up the product.
    monkeypatch.setattr(gguf_q4, "DEQUANTIZE_TILE_VALUES", 128 * 96)
    return gguf_q4.TiledProduct(gguf_q4.padded_dequantized_matmul, gguf_q4.DEQUANTIZE_MIN_ROWS)


@pytest.mark.parametrize("product", ["brgemm", "torch_mm", "torch_mm_without_cpu_kernels"])
@pytest.mark.parametrize("tensor_type", TYPES)
@pytest.mark.parametrize("num_rows", [1, 8, 16, 40, 200])
def test_q4_matmul_agrees_with_the_dequantized_oracle_at_every_size(
    product: str, tensor_type: str, num_rows: int, monkeypatch: pytest.MonkeyPatch
):
    tiled = _tiled_product(product, monkeypatch)
    calls = []
    recorded = gguf_q4.TiledProduct(
        lambda x, *args: calls.append(x.shape[0]) or tiled.matmul(x, *args), tiled.min_rows
    )
    monkeypatch.setattr(gguf_q4, "tiled_product", lambda: recorded)
    raw, oracle = _quantized(tensor_type, 320, 96)
    packed, scales_and_zeros = gguf_q4.pack_q4(raw, tensor_type)
    x = torch.randn(num_rows, 96)
    expected = x.bfloat16().float() @ oracle.t()
    out = gguf_q4.q4_matmul(x, packed, scales_and_zeros)
    assert out.dtype == torch.float32 and out.shape == (num_rows, 320)
    assert calls == ([num_rows] if num_rows >= tiled.min_rows else [])
    error = (out - expected).norm() / expected.norm()
    assert error < 1e-2, error


# M: below, at and past the kernel's blocks of 32 rows; N, K: one block of 64 outputs; one tile of
# five blocks; a tile of 640 outputs and a last one of 320 (its 768 KB tiles at K = 576, SmolLM2's
# qkv); tiles of 256 and a last one of 64 at SmolLM2's down projection's K; K from one group of 32.
@pytest.mark.parametrize("num_rows", [1, 15, 32, 33, 130])
@pytest.mark.parametrize(("n", "k"), [(64, 32), (320, 96), (960, 576), (576, 1536)])
def test_the_brgemm_kernel_is_a_float32_product_of_the_dequantized_weight(num_rows: int, n: int, k: int):
    """Against ``dequantize_packed`` (the torch formulation of the decoding) and a float32 matmul:
    the kernel rounds only its output to bf16, so it agrees to bf16's 8 significant bits, and with
    torch's bf16 mm on the same weight bit for bit on almost every output."""
    _brgemm_or_skip()
    packed, scales_and_zeros = _random_packed(n, k, seed=n + k + num_rows)
    weight = gguf_q4.dequantize_packed(packed, scales_and_zeros, 0, n)
    x = torch.randn(num_rows, k, generator=torch.Generator().manual_seed(num_rows)).bfloat16()
    out = cpu_ops.int4_prefill_matmul(x, packed, scales_and_zeros)
    expected = x.float() @ weight.float().t()
    assert out.dtype == torch.bfloat16 and out.shape == (num_rows, n)
    # Decoding rounds w = q * scale + offset once to bf16, possibly fused: a rare weight one bf16
    # step from the reference's, hence the small absolute term.
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=2e-3 * expected.abs().max().item())
    assert (out == torch.mm(x, weight.t())).double().mean() > 0.95


@pytest.mark.parametrize(("num_rows", "n"), [(130, 64), (200, 320), (64, 1024)])
def test_the_brgemm_kernel_computes_the_same_bits_on_any_number_of_threads(num_rows: int, n: int):
    """Threads split the outputs, and the rows too where outputs are fewer than threads (130 rows
    of 64 outputs on 4 threads: 3 parts): every output is still one brgemm's sum over all of K."""
    _brgemm_or_skip()
    packed, scales_and_zeros = _random_packed(n, 96, seed=n)
    x = torch.randn(num_rows, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_ops.int4_prefill_matmul(x, packed, scales_and_zeros)
        torch.set_num_threads(4)
        shared = cpu_ops.int4_prefill_matmul(x, packed, scales_and_zeros)
    finally:
        torch.set_num_threads(threads)
    weight = gguf_q4.dequantize_packed(packed, scales_and_zeros, 0, n)
    torch.testing.assert_close(alone, torch.mm(x, weight.t()), rtol=2**-7, atol=1e-2)
    assert torch.equal(alone, shared)


def test_the_brgemm_kernel_reads_rows_of_any_stride_and_checks_its_arguments():
    _brgemm_or_skip()
    packed, scales_and_zeros = _random_packed(128, 64, seed=0)
    wide = torch.randn(40, 96).bfloat16()
    x = wide[:, :64]  # rows 96 apart
    out = cpu_ops.int4_prefill_matmul(x, packed, scales_and_zeros)
    torch.testing.assert_close(
        out, cpu_ops.int4_prefill_matmul(x.contiguous(), packed, scales_and_zeros), rtol=0, atol=0
    )
    with pytest.raises(RuntimeError, match="multiple of 64"):
        cpu_ops.int4_prefill_matmul(x, packed[:-16], scales_and_zeros[:, :-16])
    with pytest.raises(RuntimeError, match="x must be a bf16"):
        cpu_ops.int4_prefill_matmul(wide, packed, scales_and_zeros)
    with pytest.raises(RuntimeError, match="scales_and_zeros"):
        cpu_ops.int4_prefill_matmul(x, packed, scales_and_zeros.float())


@pytest.mark.parametrize("tensor_type", TYPES)
def test_the_cpu_kernels_dequantization_is_the_torch_formulations(tensor_type: str):
    if not cpu_kernels_available():
        pytest.skip("the CPU kernels do not build here")
    raw, oracle = _quantized(tensor_type, 320, 96)
    packed, scales_and_zeros = gguf_q4.pack_q4(raw, tensor_type)
    for start, end in ((0, 320), (128, 256)):
        kernel = cpu_ops.int4_dequantize(packed, scales_and_zeros, start, end)
        reference = gguf_q4.dequantize_packed(packed, scales_and_zeros, start, end)
        # Each rounds q * scale + offset once to bf16 (the offset's float32 rounding may differ).
        torch.testing.assert_close(kernel.float(), reference.float(), rtol=8e-3, atol=1e-6)
        torch.testing.assert_close(kernel.float(), oracle[start:end], rtol=2e-2, atol=2e-3)
