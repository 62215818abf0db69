"""Quantized linear layers on CUDA against their CPU path (the dequantized oracle): FP8 W8A8
through torch._scaled_mm, FP8 block-scaled and W4A16 through the Triton GEMMs (and, at up to 16
rows, the skinny decode kernel), at tiny shapes and at a Llama-3.1-8B layer's (4096 x 14336) for a
decode (1 row) and a prefill (512 rows); the skinny kernel in bf16 and the activation quantization
kernel on their own."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton kernels", allow_module_level=True)
pytest.importorskip("triton", reason="the quantized GEMMs need the triton package")

from pagedllm.kernels.triton.skinny_gemm import SKINNY_MAX_M
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.quantization.fp8 import (
    ActivationScheme,
    Fp8Kernel,
    Fp8LinearMethod,
    Fp8Scheme,
    WeightScheme,
    scaled_mm_supported,
)
from pagedllm.layers.quantization.wna16 import AWQMethod, IntWeightScheme

pytestmark = pytest.mark.gpu

SHAPES = [(1, 64, 128), (7, 96, 256), (1, 14336, 4096), (512, 4096, 14336)]  # (rows, N, K)


def _layer(method, k: int, n: int, device: str, checkpoint: dict[str, torch.Tensor]) -> ReplicatedLinear:
    """A bf16 layer on ``device`` with ``method``, loaded from ``checkpoint`` through its loaders."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            layer = ReplicatedLinear(k, n, bias=False)
            method.create_weights(layer)
            layer.quant_method = method
            for name, tensor in checkpoint.items():
                getattr(layer, name).weight_loader(getattr(layer, name), tensor.to(device))
            method.process_weights_after_loading(layer)
    finally:
        torch.set_default_dtype(previous)
    return layer


def _compare(
    make_method,
    checkpoint: dict[str, torch.Tensor],
    m: int,
    n: int,
    k: int,
    kernel_attr: str,
    dequantized: torch.Tensor | None = None,
) -> None:
    """The CUDA layer against the CPU layer; at up to SKINNY_MAX_M rows an FP8 layer (given its
    ``dequantized`` weight) runs the weight-only skinny kernel, whose oracle is the dequantized
    weight times the unquantized activations (W8A16), not the CPU's W8A8 path."""
    x = torch.randn(m, k, dtype=torch.bfloat16) * 0.5
    cpu = _layer(make_method(), k, n, "cpu", checkpoint)
    gpu = _layer(make_method(), k, n, "cuda", checkpoint)
    assert kernel_attr in dict(gpu.named_buffers()), "the CUDA layer did not take its kernel"
    if dequantized is not None and m <= SKINNY_MAX_M:
        expected = (x.float() @ dequantized.float().t()).to(torch.bfloat16).float()
    else:
        expected = cpu.quant_method.apply(cpu, x, None).float()
    out = gpu.quant_method.apply(gpu, x.cuda(), None).float().cpu()
    # bf16 output rounding and fp32 accumulation order: relative to the output's scale.
    torch.testing.assert_close(out, expected, atol=2e-2 * expected.abs().max().item(), rtol=2e-2)


@pytest.mark.skipif(not scaled_mm_supported(torch.device("cuda")), reason="needs FP8 tensor cores (sm_89+)")
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_fp8_per_channel_w8a8_through_scaled_mm_matches_the_cpu_path(m: int, n: int, k: int) -> None:
    w = torch.randn(n, k) * 0.05
    scale = w.abs().amax(1, keepdim=True) / 448
    checkpoint = {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale}
    scheme = Fp8Scheme(WeightScheme.CHANNEL, ActivationScheme.DYNAMIC_TOKEN)
    dequantized = checkpoint["weight"].float() * scale
    _compare(lambda: Fp8LinearMethod(scheme), checkpoint, m, n, k, "weight_scale_row", dequantized)


@pytest.mark.skipif(not scaled_mm_supported(torch.device("cuda")), reason="needs FP8 tensor cores (sm_89+)")
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_fp8_block_scaled_through_triton_matches_the_cpu_path(m: int, n: int, k: int) -> None:
    w, block = torch.randn(n, k) * 0.05, (32, 128)
    tiles = w.view(n // block[0], block[0], k // block[1], block[1])
    scale = tiles.abs().amax(dim=(1, 3)) / 448
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k)
    scheme = Fp8Scheme(WeightScheme.BLOCK, ActivationScheme.DYNAMIC_GROUP, block, "weight_scale_inv")
    checkpoint = {"weight": q, "weight_scale_inv": scale}
    gpu = _layer(Fp8LinearMethod(scheme), k, n, "cuda", checkpoint)
    assert gpu.quant_method.kernel is Fp8Kernel.BLOCK_TRITON
    dequantized = (q.float().view_as(tiles) * scale[:, None, :, None]).view(n, k)
    _compare(lambda: Fp8LinearMethod(scheme), checkpoint, m, n, k, "weight_scale_block", dequantized)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_awq_w4a16_through_triton_matches_the_cpu_path(m: int, n: int, k: int) -> None:
    group = 64
    generator = torch.Generator().manual_seed(n)
    checkpoint = {
        "qweight": torch.randint(-(2**31), 2**31 - 1, (k, n // 8), dtype=torch.int32, generator=generator),
        "qzeros": torch.randint(
            -(2**31), 2**31 - 1, (k // group, n // 8), dtype=torch.int32, generator=generator
        ),
        "scales": (torch.rand(k // group, n, generator=generator) * 0.01 + 0.001).half(),
    }
    scheme = IntWeightScheme(4, group, symmetric=False)
    _compare(lambda: AWQMethod(scheme), checkpoint, m, n, k, "qweight_k")


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("fmt", ["fp8-channel", "fp8-block", "w4a16"])
def test_skinny_kernel_in_bf16_matches_the_dequantized_matmul(fmt: str, m: int) -> None:
    """The decode kernel with bf16 activations (the interpreter's tl.dot cannot run bf16) at an
    8B layer's o-projection, N and K off its tiles by a few rows."""
    from pagedllm.kernels.triton.quant_gemm import pack_w4a16
    from pagedllm.kernels.triton.skinny_gemm import skinny_gemm

    n, k, generator = 4096 + 40, 4096 + 128, torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=generator).bfloat16()
    if fmt == "w4a16":
        group, q = 128, torch.randint(0, 16, (n, k), generator=generator)
        scales = (torch.rand(n, k // group, generator=generator) * 0.01 + 0.001).bfloat16()
        zeros = torch.randint(0, 16, (n, k // group), generator=generator).bfloat16()
        dense = (q - zeros.float().repeat_interleave(group, 1)) * scales.float().repeat_interleave(group, 1)
        out = skinny_gemm(x.cuda(), pack_w4a16(q).cuda(), scales.cuda(), group, zeros=zeros.cuda())
    else:
        rows, group = (128, 128) if fmt == "fp8-block" else (1, k)
        q = (torch.randn(n, k, generator=generator) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-n // rows), -(-k // group), generator=generator) * 0.01 + 0.001
        dense = q.float() * scale.repeat_interleave(rows, 0)[:n].repeat_interleave(group, 1)[:, :k]
        out = skinny_gemm(x.cuda(), q.cuda(), scale.cuda(), group, rows)
    expected = x.float() @ dense.t()
    torch.testing.assert_close(
        out.float().cpu(), expected, atol=1e-2 * expected.abs().max().item(), rtol=1e-2
    )


@pytest.mark.parametrize(
    ("m", "k", "group"), [(5, 4096, 4096), (3, 14336, 14336), (4, 4096 + 64, 128), (2, 200, 64)]
)
def test_fp8_activation_quantization_kernel_is_torch_s_rounding_bit_for_bit(
    m: int, k: int, group: int
) -> None:
    """The fused Triton per-token(-group) quantization against the same function on the CPU
    (torch's e4m3 rounding, fp8_utils' convention), bf16 input, a zero row, ragged last group."""
    from pagedllm.kernels.triton.quant_gemm import quantize_per_token_group

    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3).bfloat16()
    x[0] = 0.0
    q, scale = quantize_per_token_group(x.cuda(), group)
    expected_q, expected_scale = quantize_per_token_group(x, group)
    torch.testing.assert_close(scale.cpu(), expected_scale, atol=0, rtol=0)
    assert torch.equal(q.cpu().view(torch.uint8), expected_q.view(torch.uint8))
