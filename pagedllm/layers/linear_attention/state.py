"""The shape of a linear-attention layer's per-request state, and the tensors that hold it.

A hybrid model's linear-attention layer keeps, per request, a conv window and a recurrent state;
the worker allocates one tensor of each per layer, with a row per state slot plus a scratch row
last (core/state_cache.py says who owns which row)::

    conv_state  [num_slots + 1, conv_dim, kernel - 1]        the last kernel - 1 conv inputs
    ssm_state   [num_slots + 1, *ssm_shape]                  Gated DeltaNet: [heads, d_v, d_k]

Their size does not depend on the context length: a decoding request reads and writes exactly
this much per layer and step, however long it runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerStateShape:
    """One linear-attention layer's state per request, on one rank."""

    conv_shape: tuple[int, ...]
    ssm_shape: tuple[int, ...]

    @property
    def num_elements(self) -> int:
        return math.prod(self.conv_shape) + math.prod(self.ssm_shape)


@dataclass(frozen=True)
class StateCacheSpec:
    """Every linear-attention layer's state shape (model order), the dtypes of the conv windows and
    of the recurrent states, and the slots."""

    layer_shapes: tuple[LayerStateShape, ...]
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype
    num_slots: int

    @property
    def slot_bytes(self) -> int:
        """Bytes one request's state takes over all layers."""
        conv = sum(math.prod(shape.conv_shape) for shape in self.layer_shapes) * self.conv_dtype.itemsize
        return conv + sum(math.prod(shape.ssm_shape) for shape in self.layer_shapes) * self.ssm_dtype.itemsize

    @property
    def total_bytes(self) -> int:
        """Bytes of every slot and the scratch row."""
        return (self.num_slots + 1) * self.slot_bytes


def allocate_state_cache(
    spec: StateCacheSpec, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(conv_state, ssm_state) per layer, zeroed (a slot is read only after its owner wrote it, but
    zeros keep a bug from reading NaNs)."""
    rows = spec.num_slots + 1
    return [
        (
            torch.zeros(rows, *shape.conv_shape, dtype=spec.conv_dtype, device=device),
            torch.zeros(rows, *shape.ssm_shape, dtype=spec.ssm_dtype, device=device),
        )
        for shape in spec.layer_shapes
    ]
