"""Integer weight-only experts of a FusedMoE layer (AWQ, GPTQ, compressed-tensors pack-quantized),
as AutoAWQ, GPTQModel and llm-compressor publish mixture-of-experts models: one set of tensors per
expert and projection, each in its format's linear layout (wna16.py).

Stored (this rank's), for each of ``gate_up_proj`` and ``down_proj`` and each tensor ``t`` its
format keeps for a linear layer (``qweight``, ``scales``, ``g_idx``, ``weight_packed``, ...):

    <projection>_<t>    [E, *t's shape for the projection's [n, k] shard]

with ``t``'s layout, so that FusedMoE's loader shards every expert's tensor as it shards a weight
(gate and up: the intermediate features split, each into its half; down: its inputs split; a
per-projection tensor such as ``g_idx`` by the loader here). The format's own linear method
(``IntWeightMethod``) makes the shapes, checks the shards and unpacks each expert, through
``FusedMoEProjection``, which answers what it asks of a linear layer.

After loading every expert is dequantized, exactly in float32, then held in the model dtype: the
torch path and the fused MoE kernel multiply it as a dense expert (one notice on a GPU: loaded and
correct, without the 4-bit memory or bandwidth saving yet).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.layers.quantization.base import notify_fallback
from pagedllm.layers.quantization.params import load_expert_per_projection, set_layout
from pagedllm.layers.quantization.wna16 import IntWeightMethod


@dataclass
class FusedMoEProjection:
    """One projection of the experts as a linear layer of this rank: what an ``IntWeightMethod``
    reads of one (sizes, shards), and after loading one expert's tensors as attributes."""

    output_sizes: list[int]  # whole-model outputs per merged projection (gate, up) or (down)
    output_partition_sizes: list[int]
    input_size_total: int
    tp_size: int
    weight: torch.Tensor  # [n, k] on the meta device: the shard's shape
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self.__dict__["tensors"][name]
        except KeyError:
            raise AttributeError(name) from None


class IntWeightMoEMethod:
    """The integer-quantized experts of one FusedMoE layer (see the module doc); ``make_method``
    gives the format's linear method, one per projection."""

    def __init__(self, make_method: Callable[[], IntWeightMethod]) -> None:
        self.methods = {"gate_up_proj": make_method(), "down_proj": make_method()}
        self.projections: dict[str, FusedMoEProjection] = {}

    def create_weights(self, layer: nn.Module) -> None:
        layer.params_dtype = layer.gate_up_proj.dtype
        tp = layer.tp_size
        for name, method in self.methods.items():
            _, n, k = getattr(layer, name).shape  # this rank's
            shape = torch.empty(n, k, device="meta")
            if name == "gate_up_proj":  # gate and up: column parallel, merged
                projection = FusedMoEProjection([n // 2 * tp] * 2, [n // 2] * 2, k, tp, shape)
            else:  # down: row parallel
                projection = FusedMoEProjection([n], [n], k * tp, tp, shape)
            group = method.group_size(projection)
            if projection.input_size_total % group:
                raise ValueError(
                    f"group_size={group} does not divide the experts' {projection.input_size_total} "
                    f"{name} input features"
                )
            method.check_divides(projection, group)
            method.input_size = k
            for tensor_name, (tensor, layout) in method.tensors(projection, n, k, group).items():
                stacked = torch.empty(layer.num_experts, *tensor.shape, dtype=tensor.dtype)
                param = set_layout(nn.Parameter(stacked, requires_grad=False), layout)
                param.is_down = name == "down_proj"
                param.weight_loader = (
                    load_expert_per_projection if layout.per_projection else layer.weight_loader
                )
                setattr(layer, f"{name}_{tensor_name}", param)
            delattr(layer, name)
            self.projections[name] = projection

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for name, method in self.methods.items():
            projection = self.projections[name]
            # One expert in float32 at a time beside the layer's experts in the model dtype.
            device = getattr(layer, f"{name}_{method.tensor_names[0]}").device
            shape = (layer.num_experts, *projection.weight.shape)
            dense = torch.empty(shape, dtype=layer.params_dtype, device=device)
            for expert in range(layer.num_experts):
                projection.tensors = {
                    t: getattr(layer, f"{name}_{t}").data[expert] for t in method.tensor_names
                }
                dense[expert] = method.unpack(projection).dequantize()
            projection.tensors = {}
            for tensor_name in method.tensor_names:
                delattr(layer, f"{name}_{tensor_name}")
            layer.register_buffer(name, dense, persistent=False)
        notify_fallback("integer-quantized experts (no grouped W4A16 GEMM yet)", layer.gate_up_proj.device)
