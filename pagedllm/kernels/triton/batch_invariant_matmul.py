"""A GEMM whose every output element is the same bits whatever the number of rows: ``out = x W^T (+ b)``.

Why: cuBLAS picks its kernel, tile and split-K by the problem's M (the number of tokens in the
step), and each choice sums K in another order, so a row's result depends on the batch it ran in
(Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025). Here the summation order
is a function of K and N alone:

    K is cut into ``num_splits`` ranges of ``k_per_split`` (a multiple of BLOCK_K; the last may
    be shorter), chosen per layer from (N, K, the GPU's SM count), never from M:
        partial[s] = sum over the BLOCK_K tiles of range s, in order, of x_tile @ W_tile^T   (fp32)
        out        = ((partial[0] + partial[1]) + partial[2]) + ...  (+ bias), cast to x's dtype

Every element goes through the same tiles (one fixed BLOCK_M x BLOCK_N x BLOCK_K and warp count
for every M, so one MMA instruction sequence), and a row's tile neighbours only add masked zeros
to nothing: its bits depend on its own data and on (N, K). Splitting K is what keeps a decode step
(M = 1) fast: one program per N tile would leave most SMs idle; ``num_splits`` programs per tile
fill them, the way split-K does in cuBLAS, but with a split count that does not move with M.

Two schedules compute those same sums; the host picks by M, which changes only where they run:

* ``SPLIT_IN_GRID`` (few rows and tiles, partials smaller than the weight): grid
  ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), num_splits)``; program ``(m, n, s)`` writes
  ``partial[s]`` of its tile to a float32 buffer ``[num_splits, M, N]``, then counts itself in
  on the tile's arrival counter; the program that arrives last (whichever split it is) adds the
  tile's partials in split order, adds the bias, casts and stores, and sets the counter back to 0
  for the next call (a CUDA graph replays it too). The order of the sum is fixed; only who does
  it varies. One launch per layer: a separate reduce kernel cost a launch per projection, about
  10% of a batch-1 decode step of an 8B model (224 launches a step).
* in program (many rows: the tiles fill the GPU already, and the partials would cost
  ``8 * num_splits * M * N`` bytes of traffic): grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), 1)``;
  each program runs the splits one after the other, each into a fresh accumulator, and adds them
  in the same order.

Layouts: x ``[M, K]`` (any row stride, unit column stride); weight ``[N, K]`` row-major (nn.Linear's);
bias ``[N]``; out ``[M, N]`` contiguous, x's dtype; the arrival counters ``[num_sms]`` int32, zero
between calls (a split-in-grid launch has fewer tiles than SMs). Bound: memory at decode (``2 N K``
bytes of bf16 weights, plus ``8 num_splits M N`` of partials), compute at prefill (``2 M N K`` FLOPs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.gemm_tile import output_tile


@dataclass(frozen=True)
class MatmulTiles:
    """A layer's launch configuration, the same for every M: changing any of it changes the
    numerics (the MMA instruction sequence), so it is chosen from the layer's shape (``tiles_for``),
    never from the step's."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def shared_memory_bytes(self, element_size: int) -> int:
        """The software pipeline's buffers: x and W tiles of every stage."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * element_size


TILES = MatmulTiles()
# Layers with K of LONG_K or more: K tiles twice as wide, a stage deeper. Chosen on an H100
# (``benchmarks/batch_invariant_gemm.py --sweep``, eleven configurations): at one row,
# Llama-3.1-8B's four projections and LM head take 5.55 ms a step this way against cuBLAS's 5.51
# and TILES' 6.12 (a decode step reads the weights with more bytes in flight per program), and
# they are no slower at 64, 256 and 2,048 rows but for down_proj at 2,048 (1.18x); at Qwen3-0.6B's
# K of 1,024-3,072 the same tiles are 12-20% slower than TILES at 256 and 2,048 rows.
LONG_K = 4096
LONG_K_TILES = MatmulTiles(block_k=128, num_stages=4)


def tiles_for(k: int, device: torch.device, element_size: int = 2) -> MatmulTiles:
    """A layer's tiles: from its K, its weights' element size and what the GPU's shared memory
    holds, never from M (float32 weights, or a GPU with Ampere's 163 KiB, keep TILES)."""
    if k < LONG_K:
        return TILES
    if device.type == "cuda":
        limit = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
        if LONG_K_TILES.shared_memory_bytes(element_size) > limit:
            return TILES
    return LONG_K_TILES


# The fewest K tiles per split: a shorter range spends too much of its time filling the software
# pipeline, which every M pays in the in-program schedule (measured on an H100: Qwen3-0.6B's qkv
# GEMM, 16 K tiles, at 2,048 rows takes 37 us in one split and 50 us in four).
_MIN_TILES_PER_SPLIT = 16


def num_k_splits(n: int, k: int, num_sms: int, tiles: MatmulTiles = TILES) -> int:
    """How many K ranges a layer of ``n`` outputs and ``k`` inputs sums separately: about one
    program per SM at a single row (cdiv(n, BLOCK_N) tiles x splits), each range at least
    ``_MIN_TILES_PER_SPLIT`` K tiles. A function of the layer and the GPU, never of M.

    Chosen on an H100 over 1-32 splits at W1's and W3's layer shapes and 1-2,048 rows
    (``benchmarks/batch_invariant_gemm.py --splits-sweep``): two programs per SM and 4-tile ranges
    made small-K layers up to 1.4x slower at a decode batch of 256 and at prefill, and gained
    nothing at a single row."""
    num_tiles = triton.cdiv(n, tiles.block_n)
    wanted = max(1, round(num_sms / num_tiles))
    most = max(1, triton.cdiv(k, tiles.block_k) // _MIN_TILES_PER_SPLIT)
    return min(wanted, most)


@triton.jit(do_not_specialize=["M"])
def _split_range(
    operands,  # (x_ptrs, w_ptrs, offs_k, mask_m, mask_n, stride_xk, stride_wk): the program's tile
    k_start,
    k_end,
    K,
    CONFIG: tl.constexpr,  # (BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
):
    """sum over the BLOCK_K tiles of [k_start, k_end), in order, of x_tile @ W_tile^T (fp32)."""
    x_ptrs, w_ptrs, offs_k, mask_m, mask_n, stride_xk, stride_wk = operands
    BLOCK_M: tl.constexpr = CONFIG[0]
    BLOCK_N: tl.constexpr = CONFIG[1]
    BLOCK_K: tl.constexpr = CONFIG[2]
    PRECISION: tl.constexpr = CONFIG[3]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        a = tl.load(x_ptrs + k[None, :] * stride_xk, mask=mask_m[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs + k[:, None] * stride_wk, mask=k_mask[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,  # [N], read when HAS_BIAS
    out_ptr,  # [M, N] x's dtype
    partials_ptr,  # [num_splits, M, N] float32, when SPLIT_IN_GRID
    counters_ptr,  # [>= tiles] int32 arrival counters, zero between calls, when SPLIT_IN_GRID
    M,
    N,
    K,
    k_per_split,
    num_splits,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ps,  # partials only: split and row strides
    stride_pm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_IN_GRID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m, offs_n, offs_k, mask_m, mask_n = output_tile(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    # What every split's call shares (Triton inlines the call and flattens the tuples).
    operands = (x_ptrs, w_ptrs, offs_k, mask_m, mask_n, stride_xk, stride_wk)
    CONFIG: tl.constexpr = (BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    if SPLIT_IN_GRID:
        split = tl.program_id(2)
        k_start = split * k_per_split
        acc = _split_range(operands, k_start, tl.minimum(k_start + k_per_split, K), K, CONFIG)
        mask = mask_m[:, None] & mask_n[None, :]
        partial_ptrs = partials_ptr + offs_m[:, None].to(tl.int64) * stride_pm + offs_n[None, :]
        # int64: splits x M x N partials can pass 2**31 elements (a vocabulary-sized N).
        tl.store(partial_ptrs + split.to(tl.int64) * stride_ps, acc, mask=mask)
        # Every thread's stores before the release (acq_rel) of the count: the last to arrive
        # acquires them all.
        tl.debug_barrier()
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel")
        if arrived == num_splits - 1:
            # .cg: from L2, where the other SMs' partials are, never a stale L1 line.
            acc = tl.load(partial_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            for _ in range(1, num_splits):
                partial_ptrs += stride_ps  # a 64-bit pointer: no int32 product to overflow
                acc += tl.load(partial_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counters_ptr + tile, 0)
    else:
        # The first split starts the sum (not 0 + partial[0], which would turn -0.0 into +0.0).
        acc = _split_range(operands, 0, tl.minimum(k_per_split, K), K, CONFIG)
        for split in range(1, num_splits):
            k_start = split * k_per_split
            acc += _split_range(operands, k_start, tl.minimum(k_start + k_per_split, K), K, CONFIG)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


_counters: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, num_tiles: int) -> torch.Tensor:
    """The split-in-grid launches' tile counters on ``device``, at least ``num_tiles`` of them:
    zeroed once and left at zero by every launch. The engine's launches have fewer tiles than SMs,
    so the first (made by the profile run, before any CUDA graph is captured) is the last made."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < num_tiles:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        assert not capturing, "arrival counters made during a CUDA graph capture"
        counters = _counters[device] = torch.zeros(
            max(num_tiles, num_sms(device)), dtype=torch.int32, device=device
        )
    return counters


def batch_invariant_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_splits: int,
    tiles: MatmulTiles = TILES,
    split_in_grid: bool | None = None,
) -> torch.Tensor:
    """x: [M, K], weight: [N, K], bias: [N] or None -> [M, N] in x's dtype, each row's bits
    independent of M (module docstring). ``num_splits``: the layer's ``num_k_splits``.
    ``split_in_grid``: the schedule, None to choose by M (tests force each: same bits)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.dtype == weight.dtype and x.device == weight.device and num_splits >= 1
    assert bias is None or (bias.shape == (weight.shape[0],) and bias.is_contiguous())
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    k_per_split = triton.cdiv(triton.cdiv(k, num_splits), tiles.block_k) * tiles.block_k
    num_splits = triton.cdiv(k, k_per_split)  # the same ranges, none empty
    num_tiles = triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)
    # Where the splits run (the sums are the same): across programs while the tiles alone leave
    # SMs idle and the partials (written and read back in float32) cost less traffic than the
    # weight allows, else inside each program, with nothing to write and read back. With at most
    # half the SMs busy the in-program schedule is the slower one up to partials of twice the
    # weight's bytes; with more tiles, only below half of them (H100: Llama-3.1-8B's o_proj at 256
    # rows, 128 tiles and partials as large as its weight, is faster in the program).
    if split_in_grid is None:
        sms = num_sms(x.device)
        weight_bytes = n * k * weight.element_size()
        limit = 2 * weight_bytes if 2 * num_tiles <= sms else weight_bytes // 2
        split_in_grid = num_tiles < sms and 8 * num_splits * m * n <= limit
    split_in_grid = split_in_grid and num_splits > 1
    partials = torch.empty((num_splits, m, n), dtype=torch.float32, device=x.device) if split_in_grid else out
    counters = arrival_counters(x.device, num_tiles) if split_in_grid else out
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), num_splits if split_in_grid else 1)
    _matmul_kernel[grid](
        x,
        weight,
        bias if bias is not None else x,  # a pointer never read without a bias
        out,
        partials,
        counters,
        m,
        n,
        k,
        k_per_split,
        num_splits,
        *x.stride(),
        *weight.stride(),
        partials.stride(0) if split_in_grid else 0,
        partials.stride(1) if split_in_grid else 0,
        out.stride(0),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        SPLIT_IN_GRID=split_in_grid,
        HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # ignored for 16-bit inputs
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
