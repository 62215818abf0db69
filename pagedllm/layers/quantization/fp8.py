"""FP8 linear weights: Hugging Face's ``"fp8"`` checkpoints (block-scaled as DeepSeek-V3 and
Qwen3-*-FP8 ship them, or per-tensor), compressed-tensors' float-quantized W8A8/W8A16, and
``quantization="fp8"`` on a dense checkpoint (quantized per output channel at load, as vLLM's
online FP8).

Stored per layer (this rank's shard; ``ParamLayout`` tells the layer's loaders how to cut it):

    weight            e4m3 [N, K]
    weight_scale_inv  float32 [ceil(N / bn), ceil(K / bk)]   block-scaled (HF "fp8")
    weight_scale      float32 [ceil(N / bn), ceil(K / bk)]   block-scaled (compressed-tensors)
                      float32 [N, 1]                         per channel
                      float32 [num_projections]              per tensor (one per q/k/v, gate/up)
    input_scale       float32 [num_projections]              static activation scale

What a layer computes is ``x' W'^T`` with ``W'`` the dequantized weight and ``x'`` the activation
rounded through e4m3 as the format implies (``ActivationScheme``); the CPU path computes exactly
that in the model dtype. On CUDA with FP8 units (``choose_kernel``), per-channel and per-tensor
W8A8 layers multiply through ``torch._scaled_mm`` (FP8 tensor cores, rowwise scales), block-scaled
ones through the Triton GEMM of kernels/triton/quant_gemm.py; everything else (W8A16, float32
runs, GPUs without FP8 units) runs the dequantized product, with a one-line notice. Batches of at
most ``SKINNY_MAX_M`` tokens (decode) on either fast path take the weight-only skinny GEMM of
kernels/triton/skinny_gemm.py instead: a weight-read-bound product with no activation-quantization
launch, its activations unrounded (W8A16 numerics, more accurate than the format's W8A8).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.quantization import fp8_utils
from pagedllm.layers.quantization.base import LinearMethod, notify_fallback
from pagedllm.layers.quantization.params import PER_PROJECTION, ParamLayout, check_layer_divides, set_layout

logger = logging.getLogger(__name__)


class ActivationScheme(enum.Enum):
    NONE = "none"  # weight-only (W8A16): activations stay in the model dtype
    DYNAMIC_TOKEN = "dynamic per token"
    DYNAMIC_GROUP = "dynamic per token group"  # groups of the weight block's width (DeepSeek-V3)
    STATIC_TENSOR = "static per tensor"  # the checkpoint's input_scale


class WeightScheme(enum.Enum):
    BLOCK = "block"
    CHANNEL = "channel"
    TENSOR = "tensor"


@dataclass(frozen=True)
class Fp8Scheme:
    """How one layer's FP8 weight and activations are scaled."""

    weight: WeightScheme
    activation: ActivationScheme
    block: tuple[int, int] | None = None  # [block_n, block_k] for WeightScheme.BLOCK
    scale_name: str = "weight_scale"  # the checkpoint's name of the weight scale tensor
    online: bool = False  # the checkpoint is dense: quantize per channel at load


def activation_qdq(scheme: Fp8Scheme) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None:
    """The activation rounding the scheme implies: (x [M, K], static scale or None) -> x', or None
    for weight-only schemes."""
    if scheme.activation is ActivationScheme.DYNAMIC_TOKEN:
        return lambda x, _: fp8_utils.qdq_per_token(x)
    if scheme.activation is ActivationScheme.DYNAMIC_GROUP:
        group = scheme.block[1]
        return lambda x, _: fp8_utils.qdq_per_token_group(x, group)
    if scheme.activation is ActivationScheme.STATIC_TENSOR:
        return fp8_utils.quantize_dequantize
    return None


def scaled_mm_supported(device: torch.device) -> bool:
    """FP8 tensor cores: compute capability 8.9 (Ada) or 9.0+ (Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8LinearMethod(LinearMethod):
    """One layer's FP8 weight (see the module doc)."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme
        self.qdq = activation_qdq(scheme)
        self.kernel = Fp8Kernel.DEQUANTIZED  # chosen in process_weights_after_loading, by the weight's device
        # Batches of at most this many tokens take the weight-only skinny GEMM (0: never).
        self.skinny_max_m = 0

    def create_weights(self, layer: nn.Module) -> None:
        """Replace the dense ``weight`` by the checkpoint's FP8 tensors (same loader), before loading."""
        layer.params_dtype = layer.weight.dtype
        if self.scheme.online:
            return  # the dense weight loads as it is
        n, k = layer.weight.shape
        loader = layer.weight.weight_loader
        num_projections = len(layer.output_sizes)
        params = {"weight": (torch.empty(n, k, dtype=fp8_utils.FP8_DTYPE), ParamLayout())}
        scheme = self.scheme
        if scheme.weight is WeightScheme.BLOCK:
            bn, bk = scheme.block
            check_layer_divides(layer, bn, bk, f"weight_block_size[0]={bn}", f"weight_block_size[1]={bk}")
            scale = torch.empty(-(-n // bn), -(-k // bk), dtype=torch.float32)
            params[scheme.scale_name] = (scale, ParamLayout(0, 1, bn, bk))
        elif scheme.weight is WeightScheme.CHANNEL:
            params[scheme.scale_name] = (torch.empty(n, 1, dtype=torch.float32), ParamLayout(0, None))
        else:
            params[scheme.scale_name] = (torch.empty(num_projections, dtype=torch.float32), PER_PROJECTION)
        if scheme.activation is ActivationScheme.STATIC_TENSOR:
            params["input_scale"] = (torch.empty(num_projections, dtype=torch.float32), PER_PROJECTION)
        for name, (tensor, layout) in params.items():
            param = set_layout(nn.Parameter(tensor, requires_grad=False), layout)
            param.weight_loader = loader
            setattr(layer, name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight, scale = self._fp8_weight_and_scale(layer)
        input_scale = getattr(layer, "input_scale", None)
        if input_scale is not None:
            # One scale for the merged projections, their largest (vLLM's choice): calibration
            # sees the same input for q, k and v (gate and up), so they agree in practice.
            del layer.input_scale
            layer.register_buffer("input_scale", input_scale.data.max().reshape(1), persistent=False)
        for name in ("weight", self.scheme.scale_name):
            if hasattr(layer, name):
                delattr(layer, name)
        self.kernel = choose_kernel(self.scheme, weight, layer.params_dtype)
        if self.kernel is not Fp8Kernel.DEQUANTIZED:
            from pagedllm.kernels.triton import skinny_gemm

            self.skinny_gemm = skinny_gemm.skinny_gemm
            self.skinny_max_m = skinny_gemm.SKINNY_MAX_M
            skinny_gemm.reserve(weight.device)
        if self.kernel is Fp8Kernel.SCALED_MM:
            from pagedllm.kernels.triton.quant_gemm import quantize_per_token_group

            self.quantize_per_token_group = quantize_per_token_group
            # [K, N] column-major, as _scaled_mm takes its second operand; scales [1, N].
            layer.register_buffer("weight_fp8", weight.t(), persistent=False)
            layer.register_buffer("weight_scale_row", scale.reshape(1, -1), persistent=False)
        elif self.kernel is Fp8Kernel.BLOCK_TRITON:
            from pagedllm.kernels.triton.quant_gemm import fp8_block_gemm

            self.block_gemm = fp8_block_gemm
            layer.register_buffer("weight_fp8", weight, persistent=False)
            layer.register_buffer("weight_scale_block", scale.float().contiguous(), persistent=False)
        else:
            dense = fp8_utils.dequantize_weight(weight, scale, self.scheme.block)
            layer.register_buffer("weight", dense.to(layer.params_dtype), persistent=False)

    def _fp8_weight_and_scale(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The loaded e4m3 weight and its scale, per channel ([N, 1]) unless block-scaled."""
        if self.scheme.online:
            return fp8_utils.quantize_weight_per_channel(layer.weight.data)
        weight, scale = layer.weight.data, getattr(layer, self.scheme.scale_name).data
        if self.scheme.weight is WeightScheme.TENSOR:
            # One scale per projection, spread over its rows of this rank: exactly per channel.
            sizes = layer.output_partition_sizes
            scale = scale.repeat_interleave(torch.tensor(sizes, device=scale.device)).reshape(-1, 1)
        return weight, scale

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is Fp8Kernel.DEQUANTIZED:
            if self.qdq is not None:
                x = self.qdq(x, getattr(layer, "input_scale", None))
            return F.linear(x, layer.weight, bias)
        if x.shape[0] <= self.skinny_max_m:
            out = self.apply_skinny(layer, x)
        elif self.kernel is Fp8Kernel.SCALED_MM:
            out = self.apply_scaled_mm(layer, x)
        else:
            out = self.block_gemm(x, layer.weight_fp8, layer.weight_scale_block, self.scheme.block)
        return out if bias is None else out.add_(bias)

    def apply_skinny(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Decode-sized batches: the FP8 weight read once, activations kept in their dtype (W8A16
        numerics, no activation-quantization kernel; kernels/triton/skinny_gemm.py)."""
        if self.kernel is Fp8Kernel.SCALED_MM:  # the [N, K] rows under _scaled_mm's [K, N] view
            weight, scale = layer.weight_fp8.t(), layer.weight_scale_row.view(-1, 1)
            return self.skinny_gemm(x, weight, scale, group_k=x.shape[1])
        block_n, block_k = self.scheme.block
        return self.skinny_gemm(x, layer.weight_fp8, layer.weight_scale_block, block_k, block_n)

    def apply_scaled_mm(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """FP8 x FP8 on the tensor cores, rowwise scales: the activation's per token (dynamic, or
        the static scale repeated), the weight's per output channel."""
        input_scale = getattr(layer, "input_scale", None)
        if input_scale is None:  # one fused launch: amax, scale and rounding per token
            x_fp8, x_scale = self.quantize_per_token_group(x, x.shape[1])
        else:
            x_scale = input_scale.expand(x.shape[0], 1).contiguous()
            x_fp8 = (x.float() / x_scale).clamp(-fp8_utils.FP8_MAX, fp8_utils.FP8_MAX).to(fp8_utils.FP8_DTYPE)
        scale_w = layer.weight_scale_row
        return torch._scaled_mm(x_fp8, layer.weight_fp8, scale_a=x_scale, scale_b=scale_w, out_dtype=x.dtype)


class Fp8Kernel(enum.Enum):
    SCALED_MM = "torch._scaled_mm"  # per-channel/tensor weights, FP8 activations
    BLOCK_TRITON = "triton block-scaled GEMM"  # kernels/triton/quant_gemm.py
    DEQUANTIZED = "dequantized"  # the CPU's path, and the fallback


def choose_kernel(scheme: Fp8Scheme, weight: torch.Tensor, dtype: torch.dtype) -> Fp8Kernel:
    """The product a layer runs, chosen once at load from its device and format."""
    device = weight.device
    if device.type == "cpu":
        return Fp8Kernel.DEQUANTIZED  # by design: the oracle
    fast = scaled_mm_supported(device) and dtype in (torch.bfloat16, torch.float16)
    if fast and scheme.weight is WeightScheme.BLOCK:
        from pagedllm.kernels.triton.quant_gemm import fp8_block_fits

        if fp8_block_fits(scheme.block[1], weight.shape[1]):
            return Fp8Kernel.BLOCK_TRITON
    elif fast and scheme.activation is not ActivationScheme.NONE and dtype == torch.bfloat16:
        return Fp8Kernel.SCALED_MM  # rowwise scales: bf16 output only
    what = "FP8 weights" if scaled_mm_supported(device) else "FP8 weights (no FP8 tensor cores here)"
    notify_fallback(f"{what} of scheme {scheme.weight.value}/{scheme.activation.value}", device)
    return Fp8Kernel.DEQUANTIZED
