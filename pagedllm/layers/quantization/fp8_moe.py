"""FP8 experts of a FusedMoE layer: Hugging Face's block-scaled ``"fp8"`` checkpoints (Qwen3-MoE-FP8,
DeepSeek-V3's format) and compressed-tensors' float-quantized ones (llm-compressor's FP8-dynamic:
per-channel or per-tensor weight scales, dynamic per-token activations) with one tensor per expert
and projection, or online FP8 of dense experts.

Stored (this rank's; each expert's tensors in the layout of a linear weight, so FusedMoE's loader
shards them as it shards the weights):

    gate_up_proj                     e4m3 [E, 2 I, H]
    gate_up_proj_<scale>             float32 [E, 2 I / bn, H / bk]   block (weight_scale_inv)
                                     float32 [E, 2 I, 1]             per channel (weight_scale)
                                     float32 [E, 2]                  per tensor: gate's, up's
    down_proj                        e4m3 [E, H, I]
    down_proj_<scale>                float32 [E, H / bn, I / bk], [E, H, 1] or [E, 1]

After loading the experts are dequantized to the model dtype, and each expert matmul's input is
rounded through FP8 as the format implies (per token group for block scales, per token for online
FP8): the reference of an FP8 grouped GEMM, and the path the CPU runs. On CUDA the fused MoE
kernel multiplies the dequantized experts without rounding the activations (one notice): loaded
and correct to the dequantized weights, but no FP8 speed or memory saving yet.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.quantization import fp8_utils
from pagedllm.layers.quantization.base import notify_fallback
from pagedllm.layers.quantization.fp8 import ActivationScheme, Fp8Scheme, WeightScheme, activation_qdq
from pagedllm.layers.quantization.params import (
    PER_PROJECTION,
    ParamLayout,
    check_shards_divide,
    load_expert_per_projection,
    set_layout,
)


class Fp8MoEMethod:
    """The FP8 experts of one FusedMoE layer (see the module doc)."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        if scheme.activation is ActivationScheme.STATIC_TENSOR:
            raise ValueError(
                "FP8 experts with static activation scales (input_scale per expert) are not supported; "
                "dynamic per-token or per-group activations are"
            )
        self.scheme = scheme

    def create_weights(self, layer: nn.Module) -> None:
        layer.params_dtype = layer.gate_up_proj.dtype
        if self.scheme.online:
            return
        if self.scheme.weight is WeightScheme.BLOCK:
            bn, bk = self.scheme.block
            i_total = layer.intermediate_size_per_rank * layer.tp_size
            name = type(layer).__name__
            check_shards_divide(
                [i_total], bn, layer.tp_size, f"weight_block_size[0]={bn}", name, "gate/up output"
            )
            check_shards_divide(
                [i_total], bk, layer.tp_size, f"weight_block_size[1]={bk}", name, "down input"
            )
        for projection, is_down in (("gate_up_proj", False), ("down_proj", True)):
            e, n, k = getattr(layer, projection).shape
            tensors = {
                projection: (torch.empty(e, n, k, dtype=fp8_utils.FP8_DTYPE), ParamLayout()),
                f"{projection}_{self.scheme.scale_name}": self._scale(e, n, k, is_down),
            }
            for param_name, (tensor, layout) in tensors.items():
                param = set_layout(nn.Parameter(tensor, requires_grad=False), layout)
                loader = load_expert_per_projection if layout.per_projection else layer.weight_loader
                param.weight_loader, param.is_down = loader, is_down
                setattr(layer, param_name, param)

    def _scale(self, e: int, n: int, k: int, is_down: bool) -> tuple[torch.Tensor, ParamLayout]:
        """The stacked weight scale of one projection (this rank's [n, k]) and its layout."""
        if self.scheme.weight is WeightScheme.BLOCK:
            bn, bk = self.scheme.block
            shape = (e, n // bn if not is_down else -(-n // bn), -(-k // bk))
            return torch.empty(shape, dtype=torch.float32), ParamLayout(0, 1, bn, bk)
        if self.scheme.weight is WeightScheme.CHANNEL:  # one per output row: whole on a down rank
            return torch.empty(e, n, 1, dtype=torch.float32), ParamLayout(0, None)
        # One per projection: gate's and up's, or down's.
        return torch.empty(e, 1 if is_down else 2, dtype=torch.float32), PER_PROJECTION

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for projection in ("gate_up_proj", "down_proj"):
            weight = getattr(layer, projection).data
            dense = torch.stack(
                [self._dequantize_expert(layer, projection, e, w) for e, w in enumerate(weight)]
            )
            delattr(layer, projection)
            scale_name = f"{projection}_{self.scheme.scale_name}"
            if hasattr(layer, scale_name):
                delattr(layer, scale_name)
            layer.register_buffer(projection, dense.to(layer.params_dtype), persistent=False)
        qdq = activation_qdq(self.scheme)  # None: weight-only (W8A16), activations as they are
        layer.activation_qdq = None if qdq is None else lambda x: qdq(x, None)
        # The fused MoE kernel takes the dense experts and leaves activations unrounded.
        notify_fallback("FP8 experts (no FP8 grouped GEMM yet)", layer.gate_up_proj.device)

    def _dequantize_expert(
        self, layer: nn.Module, projection: str, expert: int, weight: torch.Tensor
    ) -> torch.Tensor:
        if self.scheme.online:
            weight, scale = fp8_utils.quantize_weight_per_channel(weight)
            return fp8_utils.dequantize_weight(weight, scale, None)
        scale = getattr(layer, f"{projection}_{self.scheme.scale_name}").data[expert]
        if self.scheme.weight is WeightScheme.TENSOR:  # gate's rows, then up's (or down's)
            scale = scale.repeat_interleave(weight.shape[0] // len(scale))[:, None]
        return fp8_utils.dequantize_weight(weight, scale, self.scheme.block)
