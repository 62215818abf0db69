"""Weight-loading helpers shared by the layers."""

from __future__ import annotations

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
