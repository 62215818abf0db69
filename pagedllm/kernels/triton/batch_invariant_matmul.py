"""A GEMM whose every output element is the same bits whatever the number of rows: ``out = x W^T (+ b)``.

Why: cuBLAS picks its kernel, tile and split-K by the problem's M (the number of tokens in the
step), and each choice sums K in another order, so a row's result depends on the batch it ran in
(Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025). Here the summation order
is a function of K and N alone:

    K is cut into ``num_splits`` ranges of ``k_per_split`` (a multiple of BLOCK_K; the last may
    be shorter), chosen per layer from (N, K, the GPU's SM count), never from M:
        partial[s] = sum over the BLOCK_K tiles of range s, in order, of x_tile @ W_tile^T   (fp32)
        out        = ((partial[0] + partial[1]) + partial[2]) + ...  (+ bias), cast to x's dtype

Every element goes through the same K tiles (one BLOCK_K per layer, so one sequence of MMA
instructions along K, each accumulating into the element's float32 sum in order), and a row's tile
neighbours only add masked zeros to nothing: its bits depend on its own data and on (N, K). The
output tile (BLOCK_M x BLOCK_N, warps, pipeline stages) decides only which program computes an
element, not how: a layer has its narrow tiles, narrower ones for few rows
(``FEW_ROWS_TILES``: more programs for a memory-bound product) and ``wide_tiles`` for many (a
prefill chunk, the LM head over a large batch), all with its BLOCK_K, and which one runs is chosen
by M (``LayerGemm.tiles_for_rows``). They give the same bits because the MMA computes each
element's k-step alike whatever the instruction's M and N (a tensor core's product of one row and
one column, added to that element's accumulator): checked bit for bit on the GPU at every layer
shape of W1 and W3 from 1 to 8,192 rows (``benchmarks/batch_invariant_gemm.py --wide`` and
``--few-rows``), by the kernel tests, and end to end by the engine's tests, where a decode (few-rows
tiles) and the scoring prefill of the same tokens (wide) must report the same logprobs.

Splitting K is what keeps a decode step (M = 1) fast: one program per N tile would leave most SMs
idle; ``num_splits`` programs per tile fill them, the way split-K does in cuBLAS, but with a split
count that does not move with M.

Two schedules compute those same sums; the host picks by M, which changes only where they run:

* ``SPLIT_IN_GRID`` (few rows and tiles, partials smaller than the weight): grid
  ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), num_splits)``; program ``(m, n, s)`` writes
  ``partial[s]`` of its tile to a float32 buffer ``[num_splits, M, N]``, then counts itself in
  on the tile's arrival counter; the program that arrives last (whichever split it is) adds the
  tile's partials in split order, adds the bias, casts and stores, and sets the counter back to 0
  for the next call (a CUDA graph replays it too; split_k.py). The order of the sum is fixed;
  only who does it varies. One launch per layer: a separate reduce kernel cost a launch per projection, about
  10% of a batch-1 decode step of an 8B model (224 launches a step).
* in program (many rows: the tiles fill the GPU already, and the partials would cost
  ``8 * num_splits * M * N`` bytes of traffic): grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), 1)``;
  each program runs the splits one after the other, each into a fresh accumulator, and adds them
  in the same order.

Layouts: x ``[M, K]`` (any row stride, unit column stride); weight ``[N, K]`` row-major (nn.Linear's);
bias ``[N]``; out ``[M, N]`` contiguous, x's dtype; the arrival counters int32, one per tile, zero
between calls. Bound: memory at decode (``2 N K`` bytes of bf16 weights, plus ``8 num_splits M N``
of partials), compute at prefill (``2 M N K`` FLOPs).

Launched with programmatic dependent launch on Hopper (``pdl.py``): the programs are scheduled
while the kernel before them (an RMSNorm, the attention, another GEMM) drains, and wait for it
before their first load, the arrival counters' included; a decode step of an 8B model runs 128 of
these launches a token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.gemm_tile import output_tile
from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel
from pagedllm.kernels.triton.split_k import arrival_counters, num_sms, sum_splits_in_order


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


def _fits(tiles: MatmulTiles, device: torch.device, element_size: int) -> bool:
    """Whether the GPU's shared memory holds ``tiles``' pipeline (Hopper's 227 KiB for the
    interpreter)."""
    if device.type == "cuda":
        limit = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    else:
        limit = 227 * 1024
    return tiles.shared_memory_bytes(element_size) <= limit


def tiles_for(k: int, device: torch.device, element_size: int = 2) -> MatmulTiles:
    """A layer's tiles: from its K, its weights' element size and what the GPU's shared memory
    holds, never from M (float32 weights, or a GPU with Ampere's 163 KiB, keep TILES)."""
    if k < LONG_K or (device.type == "cuda" and not _fits(LONG_K_TILES, device, element_size)):
        return TILES
    return LONG_K_TILES


# Wide output tiles for many rows (``benchmarks/batch_invariant_gemm.py --wide``, H200, W1's and
# W3's layers from 64 to 8,192 rows; raw results/h200x2_2026-11-28_batch_invariant_wide.json):
# 128 x 128 outputs in eight warps, three stages, were the fastest of four candidates at the layer's
# BLOCK_K wherever a wide tile won (128 x 256 spills its accumulators: up to 5x slower on the
# split layers), and gave the narrow tiles' bits at every shape. They win once their count fills
# a share of the SMs that depends on the depth of K: half of them at BLOCK_K 64 (Qwen3-0.6B's qkv
# at 512 rows: 10.3 against 11.2 us; at 256 rows the narrow ones win, 7.5 against 9.7), a quarter
# at BLOCK_K 128 (Llama-3.1-8B's o_proj at 256 rows: 24.1 against 28.9 us), and never below one
# tile of rows (the LM head at 64 rows: 92 against 84 us).
WIDE_SM_SHARE = {64: 2, 128: 4}  # wide from cdiv(SMs, share) tiles


# A wide program of a split layer runs its K ranges one after another, refilling the pipeline at
# each: a fourth stage hides more of it (H200, 16,384 rows, raw
# results/h200x2_2026-11-28_wide_split_stages.json: Qwen3-0.6B's o_proj, 2 splits, 173 us against
# 207 with three, its down_proj, 3 splits, 253 against 299; equal at 2,048 rows). A layer of one
# split is faster with three (Qwen3-0.6B's qkv at 16,384 rows: 261 against 287 us), and
# Llama-3.1-8B's BLOCK_K of 128 leaves no room for a fourth.
WIDE_SPLIT_STAGES = 4


def wide_tiles(
    tiles: MatmulTiles, device: torch.device, element_size: int = 2, num_splits: int = 1
) -> MatmulTiles | None:
    """The output tiles for many rows, with ``tiles``' BLOCK_K (so the same sums): 128 x 128
    outputs in two warp groups, each weight tile read from L2 feeding twice the rows; a stage
    deeper for a layer of several K splits where it fits (``WIDE_SPLIT_STAGES``). None where the
    GPU's shared memory does not hold their pipeline (float32's long-K tiles, or long-K tiles on
    a GPU with less than Hopper's 227 KiB)."""
    wide = MatmulTiles(block_m=128, block_n=128, block_k=tiles.block_k, num_warps=8, num_stages=3)
    deeper = replace(wide, num_stages=WIDE_SPLIT_STAGES)
    if num_splits > 1 and _fits(deeper, device, element_size):
        return deeper
    return wide if _fits(wide, device, element_size) else None


# Narrower output tiles for few rows (``benchmarks/batch_invariant_gemm.py --few-rows``, H200, 1 to
# 256 rows; raw results/h200x2_2026-11-28_batch_invariant_few_rows.json): a product of few rows is
# memory-bound, and the layer's 128-wide N tiles times its K splits can leave SMs idle, so its N
# tiles narrow to 64 or 32 while the programs still make one wave. Llama-3.1-8B's o_proj at one
# row (32 tiles x 2 splits): 9.4 us with N tiles of 64 against 13.2 (cuBLAS 10.2); Qwen3-0.6B's
# qkv at 64 rows: 4.6 with 32 against 7.1 (cuBLAS 4.2). Per BLOCK_K, then BLOCK_N.
FEW_ROWS_TILES = {
    64: {64: MatmulTiles(64, 64, 64, 4, 4), 32: MatmulTiles(64, 32, 64, 4, 6)},
    128: {64: MatmulTiles(64, 64, 128, 4, 4), 32: MatmulTiles(64, 32, 128, 4, 6)},
}
FEW_ROWS_BLOCK_M = 64  # every FEW_ROWS_TILES entry's
FEW_ROW_BLOCKS = 4  # up to 4 x 64 = 256 rows


def few_rows_tiles(
    tiles: MatmulTiles,
    n: int,
    num_splits: int,
    row_blocks: int,
    sms: int,
    device: torch.device,
    element_size: int,
) -> MatmulTiles:
    """For ``row_blocks`` blocks of 64 rows: the narrowest of ``tiles`` and ``FEW_ROWS_TILES``
    (same BLOCK_K) whose programs, row blocks x N tiles x splits, still fit in one wave of SMs."""
    chosen = tiles
    for block_n in (64, 32):
        candidate = FEW_ROWS_TILES[tiles.block_k][block_n]
        if row_blocks * triton.cdiv(n, block_n) * num_splits > sms or not _fits(
            candidate, device, element_size
        ):
            break
        chosen = candidate
    return chosen


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
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
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
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        last, acc = sum_splits_in_order(acc, partial_ptrs, stride_ps, mask, counters_ptr + tile, num_splits)
        if last:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
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
        **pdl_options(x.device),
    )
    return out


@dataclass(frozen=True)
class LayerGemm:
    """A layer's batch-invariant GEMM, chosen once from its shape and the GPU: the K split and the
    narrow tiles' BLOCK_K set its numerics; up to 256 rows narrower N tiles may run
    (``FEW_ROWS_TILES``), from ``wide_from_rows`` rows the wide ones (``WIDE_SM_SHARE``), all with
    that BLOCK_K."""

    num_splits: int
    tiles: MatmulTiles
    wide: MatmulTiles | None
    wide_from_rows: int
    few_rows: tuple[MatmulTiles, ...]  # for 1, 2, ... FEW_ROW_BLOCKS blocks of 64 rows

    @classmethod
    def for_layer(
        cls, n: int, k: int, device: torch.device, element_size: int = 2, sms: int | None = None
    ) -> LayerGemm:
        """``sms``: the GPU's SM count (default: ``device``'s)."""
        tiles = tiles_for(k, device, element_size)
        sms = sms or num_sms(device)
        splits = num_k_splits(n, k, sms, tiles)
        wide = wide_tiles(tiles, device, element_size, splits)
        wide_from_rows = 0
        if wide is not None:  # the fewest rows of whole tiles whose count fills the SMs' share
            wanted = triton.cdiv(sms, WIDE_SM_SHARE[tiles.block_k])
            wide_from_rows = triton.cdiv(wanted, triton.cdiv(n, wide.block_n)) * wide.block_m
        few_rows = tuple(
            few_rows_tiles(tiles, n, splits, blocks, sms, device, element_size)
            for blocks in range(1, FEW_ROW_BLOCKS + 1)
        )
        return cls(splits, tiles, wide, wide_from_rows, few_rows)

    def tiles_for_rows(self, m: int) -> MatmulTiles:
        """The output tiles for ``m`` rows: which program computes an element, never how."""
        if self.wide is not None and m >= self.wide_from_rows:
            return self.wide
        row_blocks = max(1, triton.cdiv(m, FEW_ROWS_BLOCK_M))
        return self.few_rows[row_blocks - 1] if row_blocks <= len(self.few_rows) else self.tiles

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return batch_invariant_matmul(x, weight, bias, self.num_splits, self.tiles_for_rows(x.shape[0]))
