"""Tensor-parallel state and collectives.

The tensor-parallel group is the whole default process group: one process per device, all of
them sharding every layer (no pipeline or data parallelism yet). Nothing is cached here, so the
state is whatever ``torch.distributed`` says: without an initialized process group, or with a
group of one, this is a single rank and every collective returns its input unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_distributed_environment(
    world_size: int, rank: int, distributed_init_method: str, device: torch.device | str = "cpu"
) -> None:
    """Join the process group of ``world_size`` ranks (no-op for one rank or when already joined).

    The collectives run over NCCL when ``device`` is a GPU, over gloo on the CPU.
    """
    if world_size == 1 or dist.is_initialized():
        return
    device = torch.device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=distributed_init_method,
        world_size=world_size,
        rank=rank,
        # NCCL binds the group to this rank's GPU now, not lazily on the first collective.
        device_id=device if device.type == "cuda" else None,
    )


def destroy_distributed_environment() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size() if _is_distributed() else 1


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank() if _is_distributed() else 0


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """Sum ``input_`` over the ranks, in place; returns it."""
    if _is_distributed():
        dist.all_reduce(input_)
    return input_


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``input_`` along ``dim``, in rank order."""
    if not _is_distributed():
        return input_
    chunks = [torch.empty_like(input_) for _ in range(dist.get_world_size())]
    dist.all_gather(chunks, input_.contiguous())
    return torch.cat(chunks, dim=dim)
