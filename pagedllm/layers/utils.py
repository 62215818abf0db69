"""Helpers shared by the layers: weight loading, and the choice between torch and Triton kernels."""

from __future__ import annotations

import functools
import importlib.util

import torch


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a checkpoint tensor into (a slice of) a parameter, casting dtype and device.

    A shape mismatch means the checkpoint does not fit the config, so it is an error, never a
    broadcast.
    """
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: parameter slice {tuple(dst.shape)}, checkpoint {tuple(src.shape)}")
    dst.copy_(src)


def default_weight_loader(
    param: torch.nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
) -> None:
    """Loader of a replicated, unpacked parameter: the checkpoint tensor is the whole parameter."""
    if shard_id is not None:
        raise ValueError(f"a replicated parameter has no shards, got shard_id={shard_id!r}")
    copy_weight(param.data, loaded_weight)


def use_triton(x: torch.Tensor) -> bool:
    """Whether a layer runs its fused Triton kernel on ``x``: on CUDA tensors, where triton is
    installed. Everything else (the CPU) takes the layer's torch path, the reference the kernels
    are tested against."""
    return x.is_cuda and _triton_installed()


@functools.cache
def _triton_installed() -> bool:
    # Looked up, not imported: importing triton here would fix TRITON_INTERPRET for the process
    # and cost the import on machines that never use it.
    return importlib.util.find_spec("triton") is not None
