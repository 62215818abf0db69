"""Linear layers with LoRA: the base projection, plus every slot's adapter through ``punica``.

A wrapper replaces a projection of the model at construction when ``enable_lora`` is set (the
plain layers, and their forward, are untouched otherwise). It holds the slots' stacked weights
for this rank, sharded as the projection is (Megatron-style, as vLLM shards LoRA):

* column-parallel (q/k/v, gate/up): A ``[S * R, in]`` whole on every rank; B holds this rank's
  output rows of each slice, cut by the base layer's own weight loader (q by heads, k/v by KV
  heads, replicated when the ranks outnumber them);
* row-parallel (o, down): A holds this rank's input columns, B ``[out, S * R]`` is whole; each
  rank adds its partial LoRA sum to its partial output before the one all-reduce, which adds
  them (the expand is linear, so the sum of partial products is the product).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed import tensor_model_parallel_all_reduce
from pagedllm.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.lora.punica import LoRABatch

# (A [r, in], B [out, r]) of one slice of one adapter, scale folded into B; None: not adapted.
SliceWeights = tuple[torch.Tensor, torch.Tensor] | None


class LinearWithLoRA(nn.Module):
    """A projection and its slots. ``shard_ids``: the base weight loader's id of each slice
    (("q", "k", "v"), (0, 1), or (None,) for an unfused projection)."""

    def __init__(self, base: LinearBase, shard_ids: tuple[int | str | None, ...], batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.shard_ids = shard_ids
        self.batch = batch
        self.num_slices = len(shard_ids)
        width = self.num_slices * batch.num_slots * batch.max_rank
        # Wrapped before any weight is repacked (quantized bases are refused): [out, in] as built.
        weight = base.weight
        out_features, in_features = weight.shape
        dtype = weight.dtype
        self.register_buffer(
            "lora_a", torch.zeros(width, in_features, dtype=dtype, device=weight.device), persistent=False
        )
        self.register_buffer(
            "lora_b", torch.zeros(out_features, width, dtype=dtype, device=weight.device), persistent=False
        )
        self.slice_starts = slice_starts(base)

    def set_slot(self, slot: int, slices: list[SliceWeights]) -> None:
        """Write one adapter's slices (one per shard id) into ``slot``; None clears a slice."""
        rank = self.batch.max_rank
        for i, weights in enumerate(slices):
            start = (i * self.batch.num_slots + slot) * rank
            self.lora_a[start : start + rank].zero_()
            self.lora_b[:, start : start + rank].zero_()
            if weights is None:
                continue
            a, b = self._shard(i, *weights)
            r = a.shape[0]
            self.lora_a[start : start + r].copy_(_staged(a, self.lora_a), non_blocking=True)
            self.lora_b[:, start : start + r].copy_(_staged(b, self.lora_b), non_blocking=True)

    def _shard(self, index: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Column-parallel: this rank's rows of B for slice ``index``, at the slice's place in the
        rank's output, cut by the base layer's loader (the rest of the rows zero)."""
        b_rank = torch.zeros(self.lora_b.shape[0], b.shape[1], dtype=b.dtype)
        self.base.weight_loader(b_rank, b, self.shard_ids[index])
        return a, b_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in] -> [num_tokens, out] (this rank's sizes)."""
        # The shrink first: it reads only x, so under a CUDA graph it runs beside the base
        # projection (``LoRABatch``); the expand adds to the base's output.
        shrunk = self.batch.shrink(x, self.lora_a, self.num_slices)
        y = self.base(x)
        self.batch.expand(y, shrunk, self.lora_b, self.slice_starts)
        return y


class RowParallelLinearWithLoRA(LinearWithLoRA):
    """o_proj / down_proj: the LoRA partial sum joins the base's before the all-reduce."""

    base: RowParallelLinear

    def _shard(self, index: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a_rank = torch.zeros(a.shape[0], self.lora_a.shape[1], dtype=a.dtype)
        self.base.weight_loader(a_rank, a)
        return a_rank, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        shrunk = self.batch.shrink(x, self.lora_a, 1)
        y = base._matmul(x, base.bias if base.tp_rank == 0 else None)
        self.batch.expand(y, shrunk, self.lora_b, self.slice_starts)
        # A base built with reduce_results=False leaves the reduction to its caller.
        return tensor_model_parallel_all_reduce(y) if base.tp_size > 1 and base.reduce_results else y


def slice_starts(base: LinearBase) -> tuple[int, int]:
    """The first output row (this rank's) of slices 1 and 2 of a fused projection; the output
    size for a slice it does not have (the BGMV expand kernel's ``slice_starts``)."""
    out_features = base.weight.shape[0]
    if isinstance(base, QKVParallelLinear):
        q_size, kv_size = base.num_heads * base.head_size, base.num_kv_heads * base.head_size
        return q_size, q_size + kv_size
    if isinstance(base, MergedColumnParallelLinear) and len(base.output_sizes) == 2:
        return base.output_sizes[0] // base.tp_size, out_features
    return out_features, out_features


def _staged(host: torch.Tensor, device_tensor: torch.Tensor) -> torch.Tensor:
    """``host`` in the slot's dtype, pinned when the slot is on a GPU: the copy is then queued on
    the stream instead of waiting for the device to drain (CUDA's rule for pageable memory), so
    filling a slot does not stall the step in flight (the caching host allocator keeps the pinned
    buffer until its copy has run)."""
    host = host.to(device_tensor.dtype)
    return host.pin_memory() if device_tensor.is_cuda else host
