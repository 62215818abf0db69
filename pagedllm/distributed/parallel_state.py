"""Tensor-parallel state and collectives.

The tensor-parallel group is the whole default process group: one process per device, all of
them sharding every layer (no pipeline or data parallelism yet). The rank and size are whatever
``torch.distributed`` says: without an initialized process group, or with a group of one, this is
a single rank and every collective returns its input unchanged. The one state kept here is the
one-shot all-reduce on CUDA (``symm_mem.py``), which takes the small messages NCCL is slow at.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pagedllm.distributed.symm_mem import SymmMemAllReduce, create_symm_mem_all_reduce

# This process's one-shot all-reduce, or None (NCCL or gloo does every all-reduce).
_symm_mem_all_reduce: SymmMemAllReduce | None = None


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_distributed_environment(
    world_size: int,
    rank: int,
    distributed_init_method: str,
    device: torch.device | str = "cpu",
    custom_all_reduce: bool = True,
) -> None:
    """Join the process group of ``world_size`` ranks (no-op for one rank or when already joined).

    The collectives run over NCCL when ``device`` is a GPU, over gloo on the CPU; on a GPU, with
    ``custom_all_reduce``, small all-reduces take the one-shot kernel where the GPUs allow it.
    """
    global _symm_mem_all_reduce
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
    if custom_all_reduce:
        _symm_mem_all_reduce = create_symm_mem_all_reduce(device)


def uses_custom_all_reduce() -> bool:
    """Whether this rank's small all-reduces take the one-shot kernel."""
    return _symm_mem_all_reduce is not None


def destroy_distributed_environment() -> None:
    global _symm_mem_all_reduce
    _symm_mem_all_reduce = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size() if _is_distributed() else 1


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank() if _is_distributed() else 0


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """The sum of ``input_`` over the ranks: ``input_`` itself, summed in place (NCCL, gloo), or a
    new tensor (the one-shot kernel); use the returned tensor."""
    if not _is_distributed():
        return input_
    if _symm_mem_all_reduce is not None and _symm_mem_all_reduce.should_use(input_):
        return _symm_mem_all_reduce.all_reduce(input_)
    dist.all_reduce(input_)
    return input_


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``input_`` along ``dim``, in rank order."""
    if not _is_distributed():
        return input_
    chunks = [torch.empty_like(input_) for _ in range(dist.get_world_size())]
    dist.all_gather(chunks, input_.contiguous())
    return torch.cat(chunks, dim=dim)


def tensor_model_parallel_broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """``tensor`` as rank ``src`` holds it, on every rank (in place)."""
    if _is_distributed():
        dist.broadcast(tensor, src=src)
    return tensor
