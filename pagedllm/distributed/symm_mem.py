"""A one-shot all-reduce over CUDA symmetric memory, for the small messages of a decode step.

A tensor-parallel decode step all-reduces two activations per layer (after the attention's output
projection and after the MLP's down projection), each ``num_tokens x hidden_size``: 8 KiB for one
token of an 8B model. NCCL's ring spends several microseconds of protocol on each, and at 64 a
token that latency, not the GPUs' bandwidth, bounds a small batch (the same observation behind
vLLM's custom all-reduce and TensorRT-LLM's one-shot kernel).

One shot: every rank copies its input into a buffer that every peer can read over NVLink (torch's
symmetric memory: one allocation per rank, mapped into every peer's address space), the ranks meet
at a barrier of flags in the same memory, and each rank reads all the buffers and sums them
itself. One kernel, one barrier, no ring steps: the latency is a round of flag writes and one
remote read. Every rank adds the buffers in rank order, so every rank holds bit-identical sums (the
ranks must sample the same tokens). A second barrier at the kernel's end keeps a fast rank from
overwriting its buffer with the next message while a peer still reads the last one. The kernels
are torch's own (``torch.ops.symm_mem.one_shot_all_reduce*``), launched on the current stream, so
CUDA graphs capture them like any kernel.

Each rank reads the whole message from every peer, so for large messages (prefill) NCCL's
bandwidth-optimal algorithms win: above ``max_bytes`` the caller falls back to NCCL. NVLink
multicast (``multimem`` instructions) is never used.

The same buffer serves the all-reduce fused with the residual add and RMSNorm after it
(``kernels/triton/all_reduce_norm.py``): its data at the start, its barrier flags in a tail the
one-shot kernel never touches. Each kernel ends with a barrier, so either may follow the other.

Which path a message takes depends only on its size and dtype, never on addresses: the ranks must
all take the same one, or one would wait in a barrier the other never reaches.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Messages up to this size go through the one-shot kernel. A one-shot rank reads every peer's
# whole message, so its cost grows with size faster than NCCL's. On two H200s
# (`benchmarks/all_reduce.py`, us, NCCL / one-shot): 8 KiB 11.5 / 6.7, 2 MiB 35.0 / 21.5,
# 4 MiB 42.5 / 35.3, 8 MiB 55.8 / 62.3.
DEFAULT_MAX_BYTES = 4 * 1024 * 1024
# The kernels reduce float32 and bfloat16 only.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# The fused all-reduce + RMSNorm kernel's barrier flags, past the data (all_reduce_norm.FLAG_BYTES,
# which a test checks this equals): a uint32 per (program, sender), 64 programs, 8 ranks.
FLAG_BYTES = 64 * 8 * 4


def _alignment(tensor: torch.Tensor) -> int:
    """The vector width (16, 8 or 4 bytes) torch's kernel picks for ``tensor``: the widest that
    divides both its byte offset in its storage and its size (storages start 16-byte aligned)."""
    offset = tensor.storage_offset() * tensor.element_size()
    for width in (16, 8, 4):
        if offset % width == 0 and tensor.nbytes % width == 0:
            return width
    return 0


class SymmMemAllReduce:
    """One rank's end of the one-shot all-reduce: a symmetric buffer of ``max_bytes`` on this
    rank's GPU, rendezvoused with the group's other ranks. Build it on every rank, in the same
    order relative to other collectives (construction is a collective)."""

    def __init__(
        self, group: dist.ProcessGroup, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes + FLAG_BYTES, dtype=torch.uint8, device=device)
        self.buffer[max_bytes:].zero_()  # the fused kernel's flags rest at zero
        handle = symm_mem.rendezvous(self.buffer, self.group_name)
        if handle is None:
            raise RuntimeError("symmetric memory rendezvous returned no handle")
        self.rank = handle.rank
        # Every rank's buffer as this rank maps it, by rank: the fused kernel reads its peers' rows
        # there, and its flags at flag_offset.
        self.peer_buffers = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.flag_offset = max_bytes
        torch.cuda.synchronize(device)
        handle.barrier()

    def should_use(self, input_: torch.Tensor) -> bool:
        """Whether ``all_reduce`` takes this message; a function of its size and dtype only."""
        nbytes = input_.numel() * input_.element_size()
        return input_.dtype in SUPPORTED_DTYPES and 0 < nbytes <= self.max_bytes and nbytes % 4 == 0

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``input_`` (a new tensor of its shape); ``should_use`` must hold."""
        flat = input_.contiguous().view(-1)
        symm = self.buffer[: flat.numel() * flat.element_size()].view(flat.dtype)
        out = torch.empty_like(flat)
        if _alignment(flat) == _alignment(symm):
            # One kernel: it copies this rank's input into its buffer before the barrier.
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(symm, flat, "sum", self.group_name, out)
        else:
            # The kernel copies with the buffer's vector width: an input at an odd address is
            # copied in by a separate kernel (the collective itself is the same on every rank).
            symm.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(symm, "sum", self.group_name, out)
        return out.view(input_.shape)


def create_symm_mem_all_reduce(device: torch.device) -> SymmMemAllReduce | None:
    """The one-shot all-reduce for the default group, or None where it cannot run (no CUDA, no
    peer access between the GPUs, a torch without symmetric memory): NCCL then does every
    all-reduce. Every rank must call this; they all get the same answer."""
    if device.type != "cuda" or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return None
    group = dist.group.WORLD
    local_ok = torch.tensor([1], device=device)
    try:
        communicator: SymmMemAllReduce | None = SymmMemAllReduce(group, device)
    except Exception as e:  # unsupported topology or driver: fall back, never fail the engine
        logger.warning("one-shot all-reduce unavailable, NCCL does every all-reduce: %s", e)
        communicator = None
        local_ok.zero_()
    # A rank that failed must not leave the others on the one-shot path: agree on the minimum.
    dist.all_reduce(local_ok, op=dist.ReduceOp.MIN)
    if int(local_ok.item()) == 0:
        return None
    return communicator
