"""How a quantized checkpoint tensor lines up with its layer's weight, so that the layer's own
loaders shard it (vLLM's ``BasevLLMParameter`` family, as one small record).

A dense weight is ``[output_size, input_size]``. A quantized layer keeps several tensors instead
(packed integers, scales, zero points, a group index), each with its own layout: the output
features may run along dimension 0 or 1, several features may share one entry (eight 4-bit values
packed in an int32, one scale per 128x128 block or per group of 128 inputs), and a tensor may have
one value per projection of a merged layer (a per-tensor scale of q, k and v). ``ParamLayout``
says which; ``LinearBase``'s loaders read it to narrow every tensor to this rank's shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.distributed import get_tensor_model_parallel_rank
from pagedllm.layers.utils import CheckpointSlice, CheckpointTensor


@dataclass(frozen=True)
class ParamLayout:
    """Where a stored tensor's entries sit against the logical ``[output, input]`` weight.

    output_dim / input_dim: the stored dimension running along output / input features; None when
    the tensor does not vary along them (a per-channel scale has no input dimension, so a
    row-parallel rank takes it whole).
    output_per_entry / input_per_entry: logical features per stored entry along that dimension
    (a packing factor, a block or a group size).
    per_projection: one value per projection of a merged layer (a per-tensor scale of q, k and v),
    stacked along dimension 0 of the parameter; the other fields are then unused.
    """

    output_dim: int | None = 0
    input_dim: int | None = 1
    output_per_entry: int = 1
    input_per_entry: int = 1
    per_projection: bool = False


DENSE = ParamLayout()
PER_PROJECTION = ParamLayout(None, None, per_projection=True)


def set_layout(param: nn.Parameter, layout: ParamLayout) -> nn.Parameter:
    param.quant_layout = layout
    return param


def layout_of(param: torch.Tensor) -> ParamLayout:
    return getattr(param, "quant_layout", DENSE)


def entries(num_features: int, per_entry: int, what: str) -> int:
    """Stored entries holding ``num_features`` logical features; a partial entry is an error."""
    if num_features % per_entry:
        raise ValueError(
            f"{what}: {num_features} features are not a whole number of {per_entry}-feature entries"
        )
    return num_features // per_entry


def working_tp_sizes(total: int, unit: int, tp_size: int) -> list[int]:
    """The tensor-parallel sizes up to ``max(8, tp_size)`` whose shards of ``total`` features are whole
    units of ``unit`` (what an error proposes instead)."""
    return [tp for tp in range(1, max(8, tp_size) + 1) if total % tp == 0 and (total // tp) % unit == 0]


def check_shards_divide(sizes: list[int], unit: int, tp_size: int, what: str, layer: str, dim: str) -> None:
    """Raise when a rank's shard of one of ``sizes`` (whole-model features of each projection) is
    not a whole number of ``unit`` features; ``what`` names the unit's field (``group_size=128``)."""
    for total in sizes:
        if (total // tp_size) % unit:
            works = working_tp_sizes(total, unit, tp_size)
            raise ValueError(
                f"{what} does not divide {layer}'s {dim} shard of {total // tp_size} features "
                f"({total} over tensor_parallel_size={tp_size}); tensor_parallel_size in {works} works"
            )


def check_layer_divides(
    layer: nn.Module, output_unit: int, input_unit: int, output_what: str, input_what: str
) -> None:
    """Refuse, before loading, a linear layer whose shards cut an entry of ``output_unit`` output or
    ``input_unit`` input features (a block, a group, a packed int32). Only cut dimensions count:
    an unsharded, unmerged edge may end in a partial entry, as checkpoints store them."""
    name = type(layer).__name__
    if len(layer.output_sizes) > 1 or layer.output_partition_sizes != layer.output_sizes:
        check_shards_divide(layer.output_sizes, output_unit, layer.tp_size, output_what, name, "output")
    if layer.weight.shape[1] != layer.input_size_total:
        check_shards_divide([layer.input_size_total], input_unit, layer.tp_size, input_what, name, "input")


def load_expert_per_projection(
    param: nn.Parameter, loaded: CheckpointTensor, shard_id: tuple[int | None, int | None] | None
) -> None:
    """FusedMoE's loader for a per-projection tensor of quantized experts (``g_idx``: each input's
    group; ``weight_shape``; a per-tensor scale): one expert's into its row of ``param`` ``[E,
    projections, ...]`` (``param.is_down``: one projection, down's inputs narrowed to this rank's);
    stacked over experts (``(None, projection)``), split per expert."""
    if shard_id is None:
        raise ValueError("per-projection tensors of quantized experts come one expert at a time")
    value = loaded.read() if isinstance(loaded, CheckpointSlice) else loaded
    expert, projection = shard_id
    if expert is None:
        for e, row in enumerate(value):
            load_expert_per_projection(param, row, (e, projection))
        return
    row = param.data[expert, projection or 0]
    if value.numel() == row.numel():  # a per-tensor scale stored as [1] or []
        value = value.reshape(row.shape)
    elif param.is_down:  # down's inputs are split over the ranks
        size = row.shape[0]
        value = value.narrow(0, get_tensor_model_parallel_rank() * size, size)
    if value.shape != row.shape:
        raise ValueError(f"shape mismatch: {tuple(value.shape)} for an expert's {tuple(row.shape)}")
    row.copy_(value)
