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
  ``partial[s]`` of its tile to a float32 buffer ``[num_splits, M, N]``, and ``_reduce_kernel``
  (grid ``cdiv(M * N, BLOCK)``) adds the partials in order, adds the bias and casts.
* in program (many rows: the tiles fill the GPU already, and the partials would cost
  ``8 * num_splits * M * N`` bytes of traffic): grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), 1)``;
  each program runs the splits one after the other, each into a fresh accumulator, and adds them
  in the same order as ``_reduce_kernel``.

Layouts: x ``[M, K]`` (any row stride, unit column stride); weight ``[N, K]`` row-major (nn.Linear's);
bias ``[N]``; out ``[M, N]`` contiguous, x's dtype. Bound: memory at decode (``2 N K`` bytes of bf16
weights, plus ``8 num_splits M N`` of partials), compute at prefill (``2 M N K`` FLOPs).
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
    """The one launch configuration, for every M: changing any of it changes the numerics (the
    MMA instruction sequence), so it is a constant, not a per-shape tuning."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


TILES = MatmulTiles()
# The fewest K tiles per split: shorter ranges cost more in partials than they gain in programs.
_MIN_TILES_PER_SPLIT = 4


def num_k_splits(n: int, k: int, num_sms: int, tiles: MatmulTiles = TILES) -> int:
    """How many K ranges a layer of ``n`` outputs and ``k`` inputs sums separately: enough for two
    programs per SM at a single row (cdiv(n, BLOCK_N) tiles x splits; two, so that the SMs that
    get one more program than the others wait on a smaller share), each range at least
    ``_MIN_TILES_PER_SPLIT`` K tiles. A function of the layer and the GPU, never of M."""
    num_tiles = triton.cdiv(n, tiles.block_n)
    wanted = triton.cdiv(2 * num_sms, num_tiles)
    most = max(1, triton.cdiv(k, tiles.block_k) // _MIN_TILES_PER_SPLIT)
    return max(1, min(wanted, most))


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
    bias_ptr,  # [N], read when HAS_BIAS and not SPLIT_IN_GRID
    out_ptr,  # [M, N] x's dtype, or the partials [num_splits, M, N] float32 when SPLIT_IN_GRID
    M,
    N,
    K,
    k_per_split,
    num_splits,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_os,  # partials only
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
        out_ptrs = out_ptr + split * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])
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


@triton.jit(do_not_specialize=["M"])
def _reduce_kernel(
    partials_ptr, bias_ptr, out_ptr, MN, N, num_splits, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr
):
    """out = ((partial[0] + partial[1]) + ...) + bias, cast: the in-program schedule's order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(partials_ptr + offs, mask=mask, other=0.0)
    for split in range(1, num_splits):
        acc += tl.load(partials_ptr + split * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_REDUCE_BLOCK = 1024


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


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
    # SMs idle and the partials (4 bytes per split and output) cost less traffic than the weight
    # (2 K bytes per output), else inside each program, with nothing to write and read back.
    if split_in_grid is None:
        split_in_grid = num_tiles < num_sms(x.device) and 4 * num_splits * m <= 2 * k
    split_in_grid = split_in_grid and num_splits > 1
    target = torch.empty((num_splits, m, n), dtype=torch.float32, device=x.device) if split_in_grid else out
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), num_splits if split_in_grid else 1)
    _matmul_kernel[grid](
        x,
        weight,
        bias if bias is not None else x,  # a pointer never read without a bias
        target,
        m,
        n,
        k,
        k_per_split,
        num_splits,
        *x.stride(),
        *weight.stride(),
        target.stride(0) if split_in_grid else 0,
        target.stride(-2),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        SPLIT_IN_GRID=split_in_grid,
        HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # ignored for 16-bit inputs
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if split_in_grid:
        _reduce_kernel[(triton.cdiv(m * n, _REDUCE_BLOCK),)](
            target,
            bias if bias is not None else target,
            out,
            m * n,
            n,
            num_splits,
            BLOCK=_REDUCE_BLOCK,
            HAS_BIAS=bias is not None,
        )
    return out
