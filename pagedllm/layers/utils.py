"""Helpers shared by the layers: weight loading, and the sampler's choice of Triton kernels."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch


class CheckpointSlice:
    """A region of a checkpoint tensor that is not read yet.

    Weight loaders narrow it to this rank's shard like a tensor (``shape``, ``narrow``,
    ``split``); ``copy_weight`` then reads that region alone, so each tensor-parallel rank reads
    its shard from the file, never the whole tensor.

    Args:
        shape: the whole tensor's shape.
        read_region: reads the region given as one ``slice`` per dimension into a CPU tensor.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        read_region: Callable[[tuple[slice, ...]], torch.Tensor],
        region: tuple[slice, ...] | None = None,
    ) -> None:
        self.read_region = read_region
        self.region = region or tuple(slice(0, n) for n in shape)
        self.shape = torch.Size(r.stop - r.start for r in self.region)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointSlice:
        dim %= len(self.shape)
        if not (start >= 0 and start + length <= self.shape[dim]):
            raise ValueError(f"cannot narrow dim {dim} of {tuple(self.shape)} to [{start}, {start + length})")
        offset = self.region[dim].start + start
        region = (*self.region[:dim], slice(offset, offset + length), *self.region[dim + 1 :])
        return CheckpointSlice(self.shape, self.read_region, region)

    def split(self, sizes: list[int], dim: int = 0) -> list[CheckpointSlice]:
        starts = itertools.accumulate([0, *sizes[:-1]])
        return [self.narrow(dim, start, size) for start, size in zip(starts, sizes)]

    def read(self) -> torch.Tensor:
        return self.read_region(self.region)


# What a weight loader takes: a whole tensor, or a region of one still in the checkpoint.
CheckpointTensor = torch.Tensor | CheckpointSlice


def copy_weight(dst: torch.Tensor, src: CheckpointTensor) -> None:
    """Copy a checkpoint tensor (reading it, for a CheckpointSlice) into (a slice of) a parameter,
    casting dtype and device.

    A shape mismatch means the checkpoint does not fit the config, so it is an error, never a
    broadcast.
    """
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: parameter slice {tuple(dst.shape)}, checkpoint {tuple(src.shape)}")
    dst.copy_(src.read() if isinstance(src, CheckpointSlice) else src)


def default_weight_loader(
    param: torch.nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | str | None = None
) -> None:
    """Loader of a replicated, unpacked parameter: the checkpoint tensor is the whole parameter."""
    if shard_id is not None:
        raise ValueError(f"a replicated parameter has no shards, got shard_id={shard_id!r}")
    copy_weight(param.data, loaded_weight)
