"""The tensor-parallel all-reduce fused with the residual add and RMSNorm after it, in one kernel.

A tensor-parallel decoder layer ends each of its two blocks with a row-parallel projection whose
partial sums are all-reduced, then adds the residual stream and normalizes: on a decode step that
is an all-reduce kernel and a norm kernel per block, two launches and a round trip through memory
for a message of a few KiB, where the all-reduce's own latency (a barrier across the GPUs) is most
of the cost. Here one kernel does all of it (the fusion vLLM and TensorRT-LLM make for decode):

    copy this rank's partial rows into its symmetric buffer            (peers read them over NVLink)
    barrier with every peer
    for each row:  a = sum over ranks r, in rank order, of buffer_r[row]        # float32, rounded
                   s = a + residual;  residual = s;  x = rms_norm(s) * weight   # Llama's order
    barrier with every peer          (no rank overwrites its buffer while a peer still reads it)

Every rank sums the same values in the same order, so all ranks hold bit-identical results (they
sample the same tokens). The rounding follows the unfused path: the sum rounded to the dtype (the
all-reduce's output), then rms_norm.py's add-and-normalize.

The barrier. Ranks meet per program: program ``p`` of every rank owns the same rows, so it waits
only for program ``p`` of each peer, never for the whole grid. Each (program, sender) pair has a
32-bit flag in every rank's symmetric buffer (past the data; zero at rest). One thread per peer
signals with a release compare-and-swap 0 -> 1 on the peer's flag, retried while the peer has not
yet consumed the previous signal, then consumes its own flag from that peer with an acquire
compare-and-swap 1 -> 0; CTA barriers on either side order the program's own stores before the
release and every thread's reads of peer rows after the acquire. The flags return to zero by
themselves, so a CUDA graph replays the kernel with no host reset.

Grid: ``(min(num_rows, MAX_PROGRAMS),)``, at most one program per SM so that every program's peer
counterpart is resident (a program waits on it); program ``p`` takes rows ``p, p + G, ...``.
Layouts: x, residual [num_rows, hidden] (last dimension contiguous, any row stride); the buffers
hold rows contiguously at ``row * hidden`` elements; ``peer_buffers`` [world_size] int64, each
rank's buffer base address as this rank maps it.

Bound: latency at decode sizes (two barrier round trips over NVLink); bytes per row
``(world_size + 4) * hidden * element_size``. Measured against the one-shot all-reduce followed by
rms_norm.py's kernel (``benchmarks/all_reduce.py``, two H200s, 4,096-wide bf16 rows): 8.0 against
8.5 us for one row, 11.2 against 9.5 for eight, 61.7 against 24.5 for 256 (one program walks its
rows one at a time). The engine takes it for one row (``FUSED_MAX_ROWS``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Programs per launch, at most: co-resident on any GPU this runs on (a program spins on its
# counterparts), and enough to spread a batch's rows.
MAX_PROGRAMS = 64
# One uint32 flag per (program, sender): past the data in each rank's symmetric buffer.
MAX_WORLD_SIZE = 8
FLAG_BYTES = MAX_PROGRAMS * MAX_WORLD_SIZE * 4
# The rows the engine fuses (the module docstring's figures): a one-token decode step's.
FUSED_MAX_ROWS = 1
MAX_HIDDEN = 16384


@triton.jit
def _thread_index():
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


def _cas_loop(semantics: str, expected: int, desired: int) -> tl.constexpr:
    """PTX: compare-and-swap a 32-bit flag from ``expected`` to ``desired`` at system scope with
    ``semantics``, retried until it succeeds (labels are local to the braces' block)."""
    return tl.constexpr(f"""
        {{
            .reg .u32 %old;
            .reg .pred %done;
        retry:
            atom.global.{semantics}.sys.cas.b32 %old, [$1], {expected}, {desired};
            setp.eq.u32 %done, %old, {expected};
            @!%done bra retry;
            mov.u32 $0, %old;
        }}
        """)


# Signal a peer: release-CAS its flag 0 -> 1, retried while the previous signal is unconsumed.
_SIGNAL = _cas_loop("release", 0, 1)
# Consume a peer's signal: acquire-CAS this rank's flag 1 -> 0, waiting until the peer set it.
_CONSUME = _cas_loop("acquire", 1, 0)


@triton.jit
def _cas_until_done(flag_addr, ASM: tl.constexpr):
    tl.inline_asm_elementwise(ASM, "=r,l", [flag_addr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _barrier(peer_buffers_ptr, flag_offset, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Program ``p`` of every rank meets here (the module docstring's protocol)."""
    tl.debug_barrier()  # this program's stores before the release
    tid = _thread_index()
    if tid < WORLD_SIZE:
        slot = tl.program_id(0) * WORLD_SIZE
        peer_flags = tl.load(peer_buffers_ptr + tid) + flag_offset
        own_flags = tl.load(peer_buffers_ptr + RANK) + flag_offset
        _cas_until_done((peer_flags + 4 * (slot + RANK)).to(tl.pointer_type(tl.uint32)), _SIGNAL)
        _cas_until_done((own_flags + 4 * (slot + tid)).to(tl.pointer_type(tl.uint32)), _CONSUME)
    tl.debug_barrier()  # every thread's reads after the acquire


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    peer_buffers_ptr,
    num_rows,
    flag_offset,
    eps,
    stride_x,
    stride_r,
    HIDDEN_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RANK: tl.constexpr,
    WORLD_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < HIDDEN_SIZE
    dtype = x_ptr.dtype.element_ty
    own = tl.load(peer_buffers_ptr + RANK).to(tl.pointer_type(dtype))
    for row in range(pid, num_rows, step):
        row64 = row.to(tl.int64)
        partial = tl.load(x_ptr + row64 * stride_x + offs, mask=mask)
        tl.store(own + row64 * HIDDEN_SIZE + offs, partial, mask=mask)
    _barrier(peer_buffers_ptr, flag_offset, RANK, WORLD_SIZE)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, num_rows, step):
        row64 = row.to(tl.int64)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r in tl.static_range(WORLD_SIZE):
            peer = tl.load(peer_buffers_ptr + r).to(tl.pointer_type(dtype))
            # volatile: past L1, which does not see what a peer wrote.
            row_r = tl.load(peer + row64 * HIDDEN_SIZE + offs, mask=mask, other=0.0, volatile=True)
            acc += row_r.to(tl.float32)
        residual_ptrs = residual_ptr + row64 * stride_r + offs
        residual = tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)
        s = (acc.to(dtype).to(tl.float32) + residual).to(dtype)
        tl.store(residual_ptrs, s, mask=mask)
        s32 = s.to(tl.float32)
        normed = s32 * tl.math.rsqrt(tl.sum(s32 * s32, 0) / HIDDEN_SIZE + eps)
        out = normed.to(dtype).to(tl.float32) * weight
        tl.store(x_ptr + row64 * stride_x + offs, out.to(dtype), mask=mask)
    _barrier(peer_buffers_ptr, flag_offset, RANK, WORLD_SIZE)


def takes(x: torch.Tensor) -> bool:
    """Whether the engine sends this partial sum through the kernel: [rows, hidden] with the rows
    where it measured faster than the one-shot all-reduce then the norm (FUSED_MAX_ROWS)."""
    return x.dim() == 2 and x.shape[0] <= FUSED_MAX_ROWS and x.shape[1] <= MAX_HIDDEN


def all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    peer_buffers: torch.Tensor,
    flag_offset: int,
    rank: int,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(all_reduce(x) + residual), all_reduce(x) + residual)``, written over x and
    residual (``rms_norm.fused_add_rms_norm``'s contract, x being this rank's partial sum).

    x, residual: [num_rows, hidden_size], same dtype, hidden_size at most MAX_HIDDEN; peer_buffers:
    [world_size] int64 on x's device, every rank's symmetric buffer (its data at offset 0, at least
    ``num_rows * hidden_size`` elements; FLAG_BYTES of flags at ``flag_offset``, zero at rest).
    Every rank must make the same calls, in the same order relative to its other collectives.
    ``num_warps``: the launch's (benchmarks/all_reduce.py), else eight elements a thread.
    """
    num_rows, hidden_size = x.shape
    world_size = peer_buffers.numel()
    assert residual.shape == x.shape and residual.dtype == x.dtype and weight.shape == (hidden_size,)
    assert x.stride(1) == 1 and residual.stride(1) == 1 and weight.stride(0) == 1
    assert peer_buffers.dtype == torch.int64 and 1 < world_size <= MAX_WORLD_SIZE and 0 <= rank < world_size
    assert hidden_size <= MAX_HIDDEN, f"hidden size {hidden_size} > {MAX_HIDDEN}"
    if num_rows == 0:
        return x, residual
    block_n = triton.next_power_of_2(hidden_size)
    _all_reduce_add_rms_norm_kernel[(min(num_rows, MAX_PROGRAMS),)](
        x,
        residual,
        weight,
        peer_buffers,
        num_rows,
        flag_offset,
        eps,
        x.stride(0),
        residual.stride(0),
        HIDDEN_SIZE=hidden_size,
        BLOCK_N=block_n,
        RANK=rank,
        WORLD_SIZE=world_size,
        # Eight elements (16 bytes at 16 bits) per thread of a row, 4 to 16 warps.
        num_warps=num_warps or min(max(block_n // 256, 4), 16),
    )
    return x, residual
