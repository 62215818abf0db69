"""INT8 W8A8 linear layers: compressed-tensors' int-quantized checkpoints, as llm-compressor's
W8A8-INT8 (SmoothQuant, GPTQ) schemes write them.

Stored per layer (this rank's shard; ``ParamLayout`` tells the layer's loaders how to cut it):

    weight        int8 [N, K]                  symmetric: w = q * s
    weight_scale  float32 [N, 1]               per channel
                  float32 [num_projections]    per tensor (one per q/k/v, gate/up)
    input_scale   float32 [num_projections]    static activation scale (per tensor)

A layer computes ``x' W'^T``, ``W'`` the dequantized weight and ``x'`` the activation rounded through
int8 as compressed-tensors rounds it: ``s = amax(|x|) / 127.5`` per token (dynamic) or the
checkpoint's ``input_scale`` (static; merged projections take their largest, as for FP8), then
``round(x / s)`` clamped to [-128, 127], times ``s``. The weight is dequantized once after loading,
exactly in float32, and held in the model dtype: the CPU's path and the oracle, and on a GPU the
fallback, with one notice (no int8 GEMM yet).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.quantization.base import LinearMethod, notify_fallback
from pagedllm.layers.quantization.fp8_utils import DYNAMIC_SCALE_FLOOR
from pagedllm.layers.quantization.params import PER_PROJECTION, ParamLayout, set_layout

# compressed-tensors' symmetric int8 range: scale = amax / ((127 - (-128)) / 2).
_INT8_HALF_RANGE = 127.5


class Int8Activation(enum.Enum):
    DYNAMIC_TOKEN = "dynamic per token"
    STATIC_TENSOR = "static per tensor"  # the checkpoint's input_scale


@dataclass(frozen=True)
class Int8Scheme:
    per_channel: bool  # else one weight scale per tensor
    activation: Int8Activation


def qdq_int8(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] rounded through symmetric int8: under ``scale`` (static, broadcast) or each token's
    ``amax / 127.5`` (None); float32 arithmetic, back in x's dtype."""
    xf = x.float()
    if scale is None:
        scale = xf.abs().amax(-1, keepdim=True) / _INT8_HALF_RANGE
        # compressed-tensors' guard: only a zero scale (a zero row) is replaced, tiny ones stay.
        scale = torch.where(scale == 0, torch.full_like(scale, DYNAMIC_SCALE_FLOOR), scale)
    scale = scale.float()
    return ((xf / scale).round().clamp(-128, 127) * scale).to(x.dtype)


class Int8W8A8Method(LinearMethod):
    """One layer's int8 weight and activation rounding (see the module doc)."""

    def __init__(self, scheme: Int8Scheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: nn.Module) -> None:
        """Replace the dense ``weight`` by the checkpoint's tensors (same loader), before loading."""
        layer.params_dtype = layer.weight.dtype
        n, k = layer.weight.shape
        loader = layer.weight.weight_loader
        num_projections = len(layer.output_sizes)
        params = {"weight": (torch.empty(n, k, dtype=torch.int8), ParamLayout())}
        if self.scheme.per_channel:
            params["weight_scale"] = (torch.empty(n, 1, dtype=torch.float32), ParamLayout(0, None))
        else:
            params["weight_scale"] = (torch.empty(num_projections, dtype=torch.float32), PER_PROJECTION)
        if self.scheme.activation is Int8Activation.STATIC_TENSOR:
            params["input_scale"] = (torch.empty(num_projections, dtype=torch.float32), PER_PROJECTION)
        del layer.weight
        for name, (tensor, layout) in params.items():
            param = set_layout(nn.Parameter(tensor, requires_grad=False), layout)
            param.weight_loader = loader
            setattr(layer, name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight, scale = layer.weight.data, layer.weight_scale.data
        if not self.scheme.per_channel:  # each projection's scale over its rows of this rank
            sizes = torch.tensor(layer.output_partition_sizes, device=scale.device)
            scale = scale.repeat_interleave(sizes)
        dense = weight.float() * scale.reshape(-1, 1).float()
        del layer.weight, layer.weight_scale
        layer.register_buffer("weight", dense.to(layer.params_dtype), persistent=False)
        if self.scheme.activation is Int8Activation.STATIC_TENSOR:
            input_scale = layer.input_scale.data.max().reshape(1)
            del layer.input_scale
            layer.register_buffer("input_scale", input_scale, persistent=False)
        notify_fallback(f"INT8 W8A8 weights ({self.scheme.activation.value} activations)", dense.device)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(qdq_int8(x, getattr(layer, "input_scale", None)), layer.weight, bias)
