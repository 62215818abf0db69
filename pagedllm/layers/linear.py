"""Linear layers sharded Megatron-style across the tensor-parallel ranks.

Each rank holds a slice of every weight and loads only that slice: the ``weight_loader`` of a
parameter takes the full checkpoint tensor (or one packed shard of it) and copies this rank's part.

* Column parallel: the output features are split, ``W[out / tp, in]``; each rank computes its
  slice of the output, which feeds a row-parallel layer without communication.
* Row parallel: the input features are split, ``W[out, in / tp]``; each rank computes a partial
  sum of the full output, and an all-reduce adds them.

So an MLP or an attention block costs one all-reduce, after its row-parallel output projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from pagedllm.layers.quantization.base import LinearMethod
from pagedllm.layers.quantization.params import entries, layout_of
from pagedllm.layers.utils import CheckpointSlice, CheckpointTensor, copy_weight, default_weight_loader


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def narrow_shard(
    loaded_weight: CheckpointTensor, dim: int, shard_rank: int, shard_size: int, num_shards: int
) -> CheckpointTensor:
    """Slice ``shard_rank`` of ``loaded_weight`` along ``dim``, which must hold exactly ``num_shards``
    slices of ``shard_size`` (a narrower or wider checkpoint does not fit the config)."""
    if loaded_weight.shape[dim] != shard_size * num_shards:
        raise ValueError(
            f"shape mismatch: checkpoint {tuple(loaded_weight.shape)} should have {shard_size * num_shards} "
            f"entries along dim {dim}"
        )
    return loaded_weight.narrow(dim, shard_rank * shard_size, shard_size)


def load_sharded_parts(
    param: nn.Parameter,
    loaded_weight: CheckpointTensor,
    parts: tuple[int, ...],
    rank: int,
    tp_size: int,
) -> None:
    """Load a checkpoint tensor made of ``parts`` along its output dimension, each split across the
    ranks (a hybrid's fused projection, [q | k | v] or [z | x | B | C | dt]): this rank's slice of
    every part, end to end. ``parts``: this rank's output features of each (the checkpoint's are
    ``tp_size`` times as many).

    A quantized weight's other tensors load through the same loader, by their layout: a tensor
    packed or blocked along the output features splits by whole entries (every part must hold
    whole ones); a per-tensor scale, or one that does not vary along the outputs, loads whole."""
    layout = layout_of(param)
    if layout.per_projection:
        load_per_projection(param, loaded_weight, 0)
        return
    if layout.output_dim is None:
        copy_weight(param.data, loaded_weight)
        return
    dim = layout.output_dim
    local = [entries(size, layout.output_per_entry, "a sharded part") for size in parts]
    offset = 0
    for part, size in zip(loaded_weight.split([size * tp_size for size in local], dim=dim), local):
        copy_weight(param.data.narrow(dim, offset, size), narrow_shard(part, dim, rank, size, tp_size))
        offset += size


def load_per_projection(param: nn.Parameter, loaded_weight: CheckpointTensor, index: int) -> None:
    """Copy a per-tensor value (a scale of one projection, any shape of that many values) into
    entry ``index`` of a parameter holding one per projection (``ParamLayout.per_projection``)."""
    value = loaded_weight.read() if isinstance(loaded_weight, CheckpointSlice) else loaded_weight
    target = param.data[index]
    if value.numel() != target.numel():
        raise ValueError(
            f"shape mismatch: a per-tensor value of shape {tuple(target.shape)}, "
            f"checkpoint {tuple(value.shape)}"
        )
    target.copy_(value.reshape(target.shape))


class LinearBase(nn.Module):
    """``y = x W^T + b`` with this rank's ``W: [output_size, input_size]``, loaded whole.

    ``quant_method``, when set (by the model loader, before loading), owns how ``W`` is stored
    and multiplied (layers/quantization); the loaders and the sharding stay the layer's, and
    shard every quantized tensor by its ``ParamLayout`` (layers/quantization/params.py).

    ``output_sizes``: the whole model's output features of each projection the layer holds (q, k,
    v; gate, up; or just one), ``input_size_total`` its input features.
    """

    quant_method: LinearMethod | None = None
    quantizable: bool = True  # False: dense even in a quantized checkpoint (an MoE router)

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.output_sizes = [output_size]
        self.input_size_total = input_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | str | None = None
    ) -> None:
        if layout_of(param).per_projection and shard_id is None:
            load_per_projection(param, loaded_weight, 0)
            return
        default_weight_loader(param, loaded_weight, shard_id)

    @property
    def output_partition_sizes(self) -> list[int]:
        """This rank's output features of each projection."""
        return self.output_sizes

    def _load_projection(
        self,
        param: nn.Parameter,
        loaded_weight: CheckpointTensor,
        projection: int,
        offset: int,
        shard_rank: int,
        num_shards: int,
    ) -> None:
        """Copy slice ``shard_rank`` of ``num_shards`` of one projection's checkpoint tensor into
        this rank's output features ``[offset, offset + size)`` (size: the slice's), in the
        tensor's own layout."""
        layout = layout_of(param)
        if layout.per_projection:
            load_per_projection(param, loaded_weight, projection)
            return
        if layout.output_dim is None:  # the same for every output feature
            copy_weight(param.data, loaded_weight)
            return
        dim, per = layout.output_dim, layout.output_per_entry
        if len(self.output_sizes) == 1:  # this rank's entries, the last one maybe partial
            size = param.shape[dim]
        else:  # whole entries (check_layer_divides)
            size = entries(self.output_sizes[projection] // num_shards, per, type(self).__name__)
        shard = narrow_shard(loaded_weight, dim, shard_rank, size, num_shards)
        copy_weight(param.data.narrow(dim, entries(offset, per, type(self).__name__), size), shard)

    def _split_projections(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor
    ) -> list[CheckpointTensor]:
        """An already packed checkpoint tensor cut into its projections' tensors."""
        layout = layout_of(param)
        if layout.output_dim is None:
            raise ValueError("a tensor without an output dimension cannot be split into projections")
        sizes = [entries(n, layout.output_per_entry, "projection") for n in self.output_sizes]
        return loaded_weight.split(sizes, dim=layout.output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, input_size] -> [num_tokens, output_size] (this rank's sizes)."""
        return self._matmul(x, self.bias)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        return F.linear(x, self.weight, bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight and computes the whole output."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays split (no gather)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        super().__init__(input_size, divide(output_size, tp_size), bias)
        self.output_sizes = [output_size]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no packed shards, got shard_id={shard_id!r}")
        self._load_projection(param, loaded_weight, 0, 0, self.tp_rank, self.tp_size)

    @property
    def output_partition_sizes(self) -> list[int]:
        return [n // self.tp_size for n in self.output_sizes]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (e.g. gate and up).

    Each rank's weight is its slice of every projection, stacked: ``[gate_r; up_r]``, so the
    output splits into the projections locally. Shard ``i`` is ``output_sizes[i]``.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True) -> None:
        # Each projection is split on its own, so each must divide (not just their sum).
        for output_size in output_sizes:
            divide(output_size, get_tensor_model_parallel_world_size())
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id is None:
            # An already packed checkpoint tensor: load it projection by projection.
            for i, piece in enumerate(self._split_projections(param, loaded_weight)):
                self.weight_loader(param, piece, i)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an int in [0, {len(self.output_sizes)}), got {shard_id!r}")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        self._load_projection(param, loaded_weight, shard_id, offset, self.tp_rank, self.tp_size)


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections in one matmul, split across ranks by attention head.

    Each rank's output is ``[q heads | k heads | v heads]`` of its own heads. With more ranks than
    KV heads, each KV head is replicated on ``tp_size / total_num_kv_heads`` consecutive ranks.
    Shard ids are "q", "k", "v".
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = True,
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias)
        self.output_sizes = [n * head_size for n in (total_num_heads, total_num_kv_heads, total_num_kv_heads)]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id is None:
            for piece, qkv in zip(self._split_projections(param, loaded_weight), ("q", "k", "v")):
                self.weight_loader(param, piece, qkv)
            return
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        num_kv_shards = self.tp_size // self.num_kv_head_replicas
        # shard_id -> (projection, offset in this rank's output, slice of the checkpoint tensor, slices)
        layout = {
            "q": (0, 0, self.tp_rank, self.tp_size),
            "k": (1, q_size, kv_rank, num_kv_shards),
            "v": (2, q_size + kv_size, kv_rank, num_kv_shards),
        }
        if shard_id not in layout:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        self._load_projection(param, loaded_weight, *layout[shard_id])

    @property
    def output_partition_sizes(self) -> list[int]:
        kv_size = self.num_kv_heads * self.head_size
        return [self.num_heads * self.head_size, kv_size, kv_size]

    def head_weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | str | None = None
    ) -> None:
        """Loader of a per-query-head parameter of the attention (gpt-oss's sinks, [num_heads]):
        this rank's heads, as the q projection splits them."""
        if shard_id is not None:
            raise ValueError(f"a per-head parameter has no shards, got shard_id={shard_id!r}")
        copy_weight(param.data, narrow_shard(loaded_weight, 0, self.tp_rank, self.num_heads, self.tp_size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are summed by an all-reduce.

    The bias is whole on every rank and added once, by rank 0, before the reduction.

    ``reduce_results=False``: the layer returns this rank's partial sum and its caller reduces it,
    folded into a reduction it makes anyway (a shared expert's output joins the routed experts'
    before the MoE block's one all-reduce, layers/fused_moe/layer.py).
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, reduce_results: bool = True
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        super().__init__(divide(input_size, tp_size), output_size, bias)
        self.input_size_total = input_size
        self.reduce_results = reduce_results
        if bias:
            self.bias.weight_loader = default_weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no packed shards, got shard_id={shard_id!r}")
        dim = layout_of(param).input_dim
        if dim is None:  # the same on every rank
            super().weight_loader(param, loaded_weight)
            return
        shard = narrow_shard(loaded_weight, dim, self.tp_rank, param.shape[dim], self.tp_size)
        copy_weight(param.data, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, input_size_per_partition] -> [num_tokens, output_size]."""
        if self.tp_size == 1:
            return self._matmul(x, self.bias)
        bias = self.bias if self.tp_rank == 0 else None
        partial = self._matmul(x, bias)
        return tensor_model_parallel_all_reduce(partial) if self.reduce_results else partial
