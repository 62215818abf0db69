"""Tensor-, context- and pipeline-parallel state and collectives.

One process per device. ``world_size = tp x cp x pp`` ranks (tensor-, context- and
pipeline-parallel sizes), laid out stage-major as vLLM lays them out, tensor-parallel ranks
innermost: global rank ``r`` is tensor-parallel rank ``r % tp`` of context-parallel rank
``r // tp % cp`` of pipeline stage ``r // (tp * cp)``::

    tp = 2, pp = 2        stage 0: ranks 0, 1 (layers [0, L/2))    stage 1: ranks 2, 3 (layers [L/2, L))
    tp = 2, cp = 2        ranks 0, 1 cache tokens 0, 2, 4, ... of every sequence; ranks 2, 3 tokens 1, 3, ...

Each run of ``tp`` consecutive ranks is a tensor-parallel group: they shard every layer of their
stage (Megatron-style) and all-reduce inside it. The ranks of one stage with the same
tensor-parallel rank form a context-parallel group: they hold the same weights and the same
hidden states, each caches every ``cp``-th token of every sequence, and they merge their partial
attention by the log-sum-exp (attention/context_parallel.py; Ring Attention, Liu et al. 2023, and
the tree reduction of Tree Attention, Shyam et al. 2024). Between stages, rank ``r`` sends its
activations to rank ``r + tp x cp`` (point to point: every rank of a stage holds the whole hidden
state after its all-reduces), and the last stage's first rank, which samples, broadcasts the
sampled tokens to every rank: the first stage embeds them in the next step, and every rank's
persistent batch records them (GPipe-style stages; Huang et al. 2019, and vLLM's pipeline
parallelism).

Without an initialized process group, or with a group of one, this is a single rank and every
collective returns its input unchanged. With tensor parallelism alone the tensor-parallel group is
the default group itself. The one other state kept here is the one-shot all-reduce on CUDA
(``symm_mem.py``), which takes the small messages NCCL is slow at (tensor parallelism alone: it
spans the default group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pagedllm.distributed.symm_mem import SymmMemAllReduce, create_symm_mem_all_reduce

# This process's one-shot all-reduce, or None (NCCL or gloo does every all-reduce).
_symm_mem_all_reduce: SymmMemAllReduce | None = None
# This rank's place in the layout, set when it joins the process group (every group is joined
# through init_distributed_environment) and read by every collective, so that none asks
# torch.distributed again: ranks per stage and its rank among them, its stage and the stage
# count. The group is None with one stage (the default group), else this stage's subgroup.
_tp_size = 1
_tp_rank = 0
_pp_rank = 0
_pp_size = 1
_tp_group: dist.ProcessGroup | None = None
# Context parallelism: the ranks sharing each sequence's cache, and this rank's place among them
# (the group is None with one).
_cp_size = 1
_cp_rank = 0
_cp_group: dist.ProcessGroup | None = None
# With several stages: every rank, for the sampled tokens' broadcast. A group of its own, so that
# a stage can receive a step's samples after it sent the next step's activations (one group's
# operations run in the order they were issued).
_samples_group: dist.ProcessGroup | None = None
# Whether models built now defer their row-parallel all-reduces to the next norm (reductions_in_norms).
_reductions_in_norms = True


def init_distributed_environment(
    world_size: int,
    rank: int,
    distributed_init_method: str,
    device: torch.device | str = "cpu",
    custom_all_reduce: bool = True,
    tensor_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    reductions_in_norms: bool = True,
) -> None:
    """Join the process group of ``world_size`` ranks (no-op for one rank or when already joined),
    in tensor-parallel groups of ``tensor_parallel_size`` ranks (all of them when None),
    ``context_parallel_size`` of them per pipeline stage.

    The collectives run over NCCL when ``device`` is a GPU, over gloo on the CPU; on a GPU, with
    ``custom_all_reduce`` and tensor parallelism alone, small all-reduces take the one-shot
    kernel where the GPUs allow it. ``reductions_in_norms``: models that can defer their
    row-parallel all-reduces into the RMSNorm after them do (``reductions_in_norms()``).
    """
    global _reductions_in_norms
    _reductions_in_norms = reductions_in_norms
    global _symm_mem_all_reduce, _tp_size, _tp_rank, _pp_rank, _pp_size, _tp_group, _samples_group
    global _cp_size, _cp_rank, _cp_group
    if world_size == 1 or dist.is_initialized():
        return
    tp = tensor_parallel_size or world_size
    cp = context_parallel_size
    if world_size % (tp * cp):
        raise ValueError(
            f"world_size {world_size} is not a multiple of tensor_parallel_size {tp} x "
            f"context_parallel_size {cp}"
        )
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
    _tp_size, _tp_rank, _cp_size, _cp_rank = tp, rank % tp, cp, rank // tp % cp
    _pp_rank, _pp_size = rank // (tp * cp), world_size // (tp * cp)
    # Every rank creates every group, in the same order (torch.distributed's rule).
    if world_size > tp:
        for first in range(0, world_size, tp):
            group = dist.new_group(list(range(first, first + tp)))
            if first <= rank < first + tp:
                _tp_group = group
    if cp > 1:
        for stage in range(_pp_size):
            for tp_rank in range(tp):
                ranks = [(stage * cp + c) * tp + tp_rank for c in range(cp)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    _cp_group = group
    if _pp_size > 1:
        _samples_group = dist.new_group(list(range(world_size)))
    elif world_size == tp and custom_all_reduce:
        _symm_mem_all_reduce = create_symm_mem_all_reduce(device)


def get_symm_mem_all_reduce() -> SymmMemAllReduce | None:
    """This rank's symmetric-memory communicator (the one-shot all-reduce's), or None."""
    return _symm_mem_all_reduce


def reductions_in_norms() -> bool:
    """Whether a model built now folds its row-parallel all-reduces into the RMSNorm that follows
    them (tensor parallelism, and nothing that reads a layer's output before that norm, as
    EAGLE-3's hooks on the target's layers do): the norm then sums the partial outputs, fused with
    its residual add where the GPUs share memory (layers/layernorm.py)."""
    return _tp_size > 1 and _reductions_in_norms


def uses_custom_all_reduce() -> bool:
    """Whether this rank's small all-reduces take the one-shot kernel."""
    return _symm_mem_all_reduce is not None


def destroy_distributed_environment() -> None:
    global _symm_mem_all_reduce, _tp_size, _tp_rank, _pp_rank, _pp_size, _tp_group, _samples_group
    global _cp_size, _cp_rank, _cp_group, _reductions_in_norms
    _symm_mem_all_reduce, _reductions_in_norms = None, True
    _tp_size, _tp_rank, _pp_rank, _pp_size, _tp_group, _samples_group = 1, 0, 0, 1, None, None
    _cp_size, _cp_rank, _cp_group = 1, 0, None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_tensor_model_parallel_world_size() -> int:
    return _tp_size


def get_tensor_model_parallel_rank() -> int:
    return _tp_rank


def get_context_parallel_world_size() -> int:
    return _cp_size


def get_context_parallel_rank() -> int:
    return _cp_rank


def get_pipeline_model_parallel_world_size() -> int:
    return _pp_size


def get_pipeline_model_parallel_rank() -> int:
    return _pp_rank


def is_first_pipeline_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_last_pipeline_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def pipeline_stage_layers(num_layers: int, stage: int | None = None, num_stages: int | None = None) -> range:
    """The decoder layers of pipeline ``stage`` (this rank's when None): ``num_layers`` split into
    ``num_stages`` contiguous runs, the first ``num_layers % num_stages`` stages one layer longer."""
    stage = get_pipeline_model_parallel_rank() if stage is None else stage
    num_stages = get_pipeline_model_parallel_world_size() if num_stages is None else num_stages
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def pipeline_send(tensors: list[torch.Tensor]) -> None:
    """Send a stage's activations to the same rank of the next stage."""
    dst = dist.get_rank() + _tp_size * _cp_size
    for tensor in tensors:
        dist.send(tensor.contiguous(), dst=dst)


def pipeline_recv(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fill ``tensors`` (shaped as the previous stage sends them) from the same tensor-parallel
    rank of the previous stage; returns them."""
    src = dist.get_rank() - _tp_size * _cp_size
    for tensor in tensors:
        dist.recv(tensor, src=src)
    return tensors


def broadcast_from_last_stage(tensor: torch.Tensor) -> dist.Work | None:
    """Start filling ``tensor`` on every rank with what the last stage's first rank (the one that
    samples) holds in it; returns the operation to ``wait()`` on before reading ``tensor`` (None
    with one stage: nothing to do)."""
    if _pp_size == 1:
        return None
    source = (_pp_size - 1) * _tp_size * _cp_size
    return dist.broadcast(tensor, src=source, group=_samples_group, async_op=True)


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """The sum of ``input_`` over the ranks: ``input_`` itself, summed in place (NCCL, gloo), or a
    new tensor (the one-shot kernel); use the returned tensor."""
    if _tp_size == 1:
        return input_
    if _symm_mem_all_reduce is not None and _symm_mem_all_reduce.should_use(input_):
        return _symm_mem_all_reduce.all_reduce(input_)
    dist.all_reduce(input_, group=_tp_group)
    return input_


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``input_`` along ``dim``, in rank order."""
    if _tp_size == 1:
        return input_
    chunks = [torch.empty_like(input_) for _ in range(get_tensor_model_parallel_world_size())]
    dist.all_gather(chunks, input_.contiguous(), group=_tp_group)
    return torch.cat(chunks, dim=dim)


def tensor_model_parallel_broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """``tensor`` as tensor-parallel rank ``src`` of this stage holds it, on every rank of the
    stage (in place)."""
    if _tp_size > 1:
        dist.broadcast(tensor, src=dist.get_rank() - _tp_rank + src, group=_tp_group)
    return tensor


def context_parallel_all_gather(input_: torch.Tensor) -> torch.Tensor:
    """Every context-parallel rank's ``input_``, stacked in rank order: [cp, *input_.shape]."""
    if _cp_size == 1:
        return input_[None]
    # Gathered along dimension 0 (gloo takes no other output shape), then viewed per rank.
    shape = (_cp_size * input_.shape[0], *input_.shape[1:])
    out = torch.empty(shape, dtype=input_.dtype, device=input_.device)
    dist.all_gather_into_tensor(out, input_.contiguous(), group=_cp_group)
    return out.view(_cp_size, *input_.shape)
