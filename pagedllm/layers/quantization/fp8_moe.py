"""FP8 experts of a FusedMoE layer: Hugging Face's block-scaled ``"fp8"`` checkpoints (Qwen3-MoE-FP8,
DeepSeek-V3's format) with one tensor per expert and projection, or online FP8 of dense experts.

Stored (this rank's; each expert's tensors in the layout of a linear weight, so FusedMoE's loader
shards them as it shards the weights):

    gate_up_proj                     e4m3 [E, 2 I, H]
    gate_up_proj_weight_scale_inv    float32 [E, 2 I / bn, H / bk]
    down_proj                        e4m3 [E, H, I]
    down_proj_weight_scale_inv       float32 [E, H / bn, I / bk]

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
from pagedllm.layers.quantization.fp8 import Fp8Scheme, WeightScheme, activation_qdq
from pagedllm.layers.quantization.params import ParamLayout, check_shards_divide, set_layout


class Fp8MoEMethod:
    """The FP8 experts of one FusedMoE layer (see the module doc)."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        if scheme.weight not in (WeightScheme.BLOCK, WeightScheme.CHANNEL):
            raise ValueError(
                f"FP8 experts support block-scaled or online weights, got {scheme.weight.value} scales"
            )
        self.scheme = scheme

    def create_weights(self, layer: nn.Module) -> None:
        layer.params_dtype = layer.gate_up_proj.dtype
        if self.scheme.online:
            return
        bn, bk = self.scheme.block
        i_total = layer.intermediate_size_per_rank * layer.tp_size
        name = type(layer).__name__
        check_shards_divide(
            [i_total], bn, layer.tp_size, f"weight_block_size[0]={bn}", name, "gate/up output"
        )
        check_shards_divide([i_total], bk, layer.tp_size, f"weight_block_size[1]={bk}", name, "down input")
        for projection, is_down in (("gate_up_proj", False), ("down_proj", True)):
            weight = getattr(layer, projection)
            e, n, k = weight.shape
            scale = torch.empty(e, n // bn if not is_down else -(-n // bn), -(-k // bk), dtype=torch.float32)
            tensors = {
                projection: (torch.empty(e, n, k, dtype=fp8_utils.FP8_DTYPE), ParamLayout()),
                f"{projection}_{self.scheme.scale_name}": (scale, ParamLayout(0, 1, bn, bk)),
            }
            for param_name, (tensor, layout) in tensors.items():
                param = set_layout(nn.Parameter(tensor, requires_grad=False), layout)
                param.weight_loader, param.is_down = layer.weight_loader, is_down
                setattr(layer, param_name, param)

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
        qdq = activation_qdq(self.scheme)
        layer.activation_qdq = lambda x: qdq(x, None)
        # The fused MoE kernel takes the dense experts and leaves activations unrounded.
        notify_fallback("FP8 experts (no FP8 grouped GEMM yet)", layer.gate_up_proj.device)

    def _dequantize_expert(
        self, layer: nn.Module, projection: str, expert: int, weight: torch.Tensor
    ) -> torch.Tensor:
        if self.scheme.online:
            weight, scale = fp8_utils.quantize_weight_per_channel(weight)
            return fp8_utils.dequantize_weight(weight, scale, None)
        scale = getattr(layer, f"{projection}_{self.scheme.scale_name}").data[expert]
        return fp8_utils.dequantize_weight(weight, scale, self.scheme.block)
