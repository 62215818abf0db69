"""The CUDA paths of the quantized linear methods, run on the CPU under TRITON_INTERPRET=1 (the
kernel choice forced): a layer repacked for the Triton GEMMs computes what its dequantized path
computes. The repacking (AWQ's column order, compressed-tensors' signed values, GPTQ's zeros, FP8
block scales) is checked here; tests/gpu runs the same comparison on a device."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.triton.skinny_gemm import SKINNY_MAX_M
from pagedllm.layers.linear import MergedColumnParallelLinear
from pagedllm.layers.quantization import fp8 as fp8_module
from pagedllm.layers.quantization.fp8 import (
    ActivationScheme,
    Fp8Kernel,
    Fp8LinearMethod,
    Fp8Scheme,
    WeightScheme,
)
from pagedllm.layers.quantization.wna16 import (
    AWQMethod,
    GPTQMethod,
    IntWeightMethod,
    IntWeightScheme,
    PackQuantizedMethod,
)

K, SIZES = 64, [32, 16]  # a merged gate/up layer: 64 inputs, projections of 32 and 16 rows
N = sum(SIZES)


def _random_int32(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=generator)


def _checkpoints(method: str, group: int, generator: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """One checkpoint per projection, random but well formed."""
    out = []
    for n in SIZES:
        scales = torch.rand(n, K // group, generator=generator) * 0.01 + 0.001
        if method == "awq":
            tensors = {
                "qweight": _random_int32(K, n // 8, generator=generator),
                "qzeros": _random_int32(K // group, n // 8, generator=generator),
                "scales": scales.t(),
            }
        elif method == "gptq":
            tensors = {
                "qweight": _random_int32(K // 8, n, generator=generator),
                "qzeros": _random_int32(K // group, n // 8, generator=generator),
                "scales": scales.t(),
                "g_idx": torch.arange(K, dtype=torch.int32) // group,
            }
        else:
            tensors = {
                "weight_packed": _random_int32(n, K // 8, generator=generator),
                "weight_scale": scales,
                "weight_shape": torch.tensor([n, K]),
                "weight_zero_point": _random_int32(n // 8, K // group, generator=generator),
            }
        out.append(tensors)
    return out


def _loaded_layer(method_factory, checkpoints: list[dict[str, torch.Tensor]]) -> MergedColumnParallelLinear:
    layer = MergedColumnParallelLinear(K, SIZES, bias=False)
    method = method_factory()
    method.create_weights(layer)
    layer.quant_method = method
    for shard_id, tensors in enumerate(checkpoints):
        for name, tensor in tensors.items():
            getattr(layer, name).weight_loader(getattr(layer, name), tensor, shard_id)
    method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("num_tokens", [3, 20])  # the skinny kernel (<= 16 tokens), the GEMM
@pytest.mark.parametrize("method", ["awq", "gptq", "compressed-tensors-asym"])
def test_int4_layers_repacked_for_the_triton_gemm_compute_their_dequantized_product(
    method, num_tokens, monkeypatch
) -> None:
    group = 32
    scheme = IntWeightScheme(4, group, symmetric=False)
    factories = {
        "awq": lambda: AWQMethod(scheme),
        "gptq": lambda: GPTQMethod(IntWeightScheme(4, group), desc_act=False, zero_offset=1),
        "compressed-tensors-asym": lambda: PackQuantizedMethod(scheme, per_channel=False),
    }
    checkpoints = _checkpoints(
        method.split("-")[0] if method != "compressed-tensors-asym" else "ct",
        group,
        torch.Generator().manual_seed(0),
    )
    dense = _loaded_layer(factories[method], checkpoints)
    monkeypatch.setattr(IntWeightMethod, "kernel_fits", lambda *args: True)
    kernel = _loaded_layer(factories[method], checkpoints)
    assert kernel.quant_method.gemm is not None and not hasattr(kernel, "weight")
    x = torch.randn(num_tokens, K)
    torch.testing.assert_close(kernel(x), dense(x), atol=1e-5, rtol=1e-5)


def test_fp8_block_layers_through_the_triton_gemm_compute_their_rounded_product(monkeypatch) -> None:
    generator = torch.Generator().manual_seed(0)
    block = (16, 32)
    checkpoints = [
        {
            "weight": (torch.randn(n, K, generator=generator) * 100).clamp(-448, 448).to(torch.float8_e4m3fn),
            "weight_scale_inv": torch.rand(n // 16, K // 32, generator=generator) * 0.01,
        }
        for n in SIZES
    ]
    scheme = Fp8Scheme(WeightScheme.BLOCK, ActivationScheme.DYNAMIC_GROUP, block, "weight_scale_inv")
    dense = _loaded_layer(lambda: Fp8LinearMethod(scheme), checkpoints)
    monkeypatch.setattr(fp8_module, "choose_kernel", lambda *args: Fp8Kernel.BLOCK_TRITON)
    kernel = _loaded_layer(lambda: Fp8LinearMethod(scheme), checkpoints)
    x = torch.randn(SKINNY_MAX_M + 4, K)  # past the skinny kernel: the W8A8 GEMM
    torch.testing.assert_close(kernel(x), dense(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("weight", "activation"),
    [
        (WeightScheme.CHANNEL, ActivationScheme.DYNAMIC_TOKEN),
        (WeightScheme.TENSOR, ActivationScheme.STATIC_TENSOR),
    ],
)
def test_fp8_layers_through_scaled_mm_compute_their_rounded_product(weight, activation, monkeypatch) -> None:
    """torch._scaled_mm runs on the CPU too (float32 out): per-projection scales spread per channel,
    the static input scale of the merged projections, per-token dynamic scales."""
    generator = torch.Generator().manual_seed(0)
    checkpoints = []
    for n in SIZES:
        tensors = {"weight": (torch.randn(n, K, generator=generator) * 100).to(torch.float8_e4m3fn)}
        shape = (n, 1) if weight is WeightScheme.CHANNEL else ()
        tensors["weight_scale"] = torch.rand(shape, generator=generator) * 0.01 + 0.001
        if activation is ActivationScheme.STATIC_TENSOR:
            tensors["input_scale"] = torch.tensor(0.01 + 0.005 * len(checkpoints))
        checkpoints.append(tensors)
    scheme = Fp8Scheme(weight, activation)
    dense = _loaded_layer(lambda: Fp8LinearMethod(scheme), checkpoints)
    monkeypatch.setattr(fp8_module, "choose_kernel", lambda *args: Fp8Kernel.SCALED_MM)
    kernel = _loaded_layer(lambda: Fp8LinearMethod(scheme), checkpoints)
    x = torch.randn(SKINNY_MAX_M + 4, K)  # past the skinny kernel: the W8A8 GEMM
    torch.testing.assert_close(kernel(x), dense(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", [Fp8Kernel.SCALED_MM, Fp8Kernel.BLOCK_TRITON])
@pytest.mark.parametrize("num_tokens", [1, SKINNY_MAX_M])
def test_fp8_decode_batches_take_the_weight_only_kernel(kernel, num_tokens, monkeypatch) -> None:
    """At most SKINNY_MAX_M tokens: the FP8 weight times unrounded activations (W8A16), i.e. the
    dequantized weight's product without the format's activation rounding; bias added after."""
    generator = torch.Generator().manual_seed(num_tokens)
    checkpoints = []
    for n in SIZES:
        tensors = {
            "weight": (torch.randn(n, K, generator=generator) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        }
        if kernel is Fp8Kernel.SCALED_MM:
            tensors["weight_scale"] = torch.rand(n, 1, generator=generator) * 0.01 + 0.001
        else:
            tensors["weight_scale_inv"] = torch.rand(n // 16, K // 32, generator=generator) * 0.01
        checkpoints.append(tensors)
    if kernel is Fp8Kernel.SCALED_MM:
        scheme = Fp8Scheme(WeightScheme.CHANNEL, ActivationScheme.DYNAMIC_TOKEN)
    else:
        scheme = Fp8Scheme(WeightScheme.BLOCK, ActivationScheme.DYNAMIC_GROUP, (16, 32), "weight_scale_inv")
    dense = _loaded_layer(lambda: Fp8LinearMethod(scheme), checkpoints)
    monkeypatch.setattr(fp8_module, "choose_kernel", lambda *args: kernel)
    fast = _loaded_layer(lambda: Fp8LinearMethod(scheme), checkpoints)
    x, bias = torch.randn(num_tokens, K, generator=generator), torch.randn(N, generator=generator)
    expected = x @ dense.weight.t() + bias
    torch.testing.assert_close(fast.quant_method.apply(fast, x, bias), expected, atol=1e-4, rtol=1e-4)


def test_fp8_blocks_narrower_than_the_mma_run_dequantized_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU's FP8 MMA needs K tiles of at least 32: 128 x 128 blocks (DeepSeek-V3's) take the
    Triton block GEMM, 16-wide ones the dequantized product (a weight on a stand-in device)."""
    monkeypatch.setattr(fp8_module, "scaled_mm_supported", lambda device: True)
    weight = torch.empty(256, 512, device="meta")
    for width, expected in (
        (128, Fp8Kernel.BLOCK_TRITON),
        (32, Fp8Kernel.BLOCK_TRITON),
        (16, Fp8Kernel.DEQUANTIZED),
    ):
        scheme = Fp8Scheme(WeightScheme.BLOCK, ActivationScheme.DYNAMIC_TOKEN, block=(width, width))
        assert fp8_module.choose_kernel(scheme, weight, torch.bfloat16) is expected, width
