"""Weight-only GEMM for few tokens (decode: M <= 16): FP8 (e4m3) or 4-bit integer weights times
16-bit activations, ``out = x W^T``, read at the HBM ceiling.

At M <= 16 a layer's product is a matrix-vector product in all but name: it does ``2 M`` FLOPs per
weight it reads, far below any GPU's FLOPs per byte, so its time is the weight's bytes over the
copy bandwidth, provided enough bytes are in flight and the dequantizing arithmetic keeps up.
``torch._scaled_mm`` pads M to its tile and needs the activations quantized by a kernel of their
own first (a launch per layer); this kernel reads each weight byte once, converts it in registers
(e4m3 -> float32 is exact; ``q - z`` of 4-bit integers too), and keeps the activations in their
own dtype (W8A16 numerics: no activation rounding, so at least as accurate as W8A8).

    for each K tile of this program's K range (BLOCK_K inputs)
        w    = e4m3 weights, or 4-bit nibbles - zero                  # float32, in registers
        DOT: acc[m, n]    += x[m, k] @ (w * scale[n // SCALE_ROWS, k // GROUP])^T   # tensor cores
        FMA: acc[m, n, k] += x[m, k] * w[n, k]                         # CUDA cores, summed at the end
             (4-bit: per word i of 8 inputs, s (sum_j x q - z sum_j x), no per-weight scale)
    out = acc (* the row's scale, where one group spans K)

Two products, chosen per launch: ``DOT`` feeds the tensor cores (its 16-row tile costs nothing at
the weight-read bound, but the dequantized tile passes through shared memory into the MMA's operand
layout, and e4m3 widens through a quarter-rate conversion); ``FMA`` multiplies in the registers
the weights were loaded into, one FMA per weight and row, for one row (4-bit: up to four). A 4-bit
word is taken a nibble plane at a time (plane j: input 8 i + j of every word i, in the words' own
register layout), and a nibble becomes a float with no int -> float conversion (16 a clock per SM
on Hopper, an eighth of the FMA rate): nibble j < 5 masked in place and OR-ed into the mantissa of
2**23 is the float ``2**23 + q 16**j``, so one LOP3 and one FADD give ``q 16**j`` exactly, and the
activation is scaled by ``16**-j`` instead (once per input, not per weight); nibbles 5-7 the same
from ``word >> 20``. FP8 in the FMA product: per channel or tensor only (block scales take DOT).

Grid: ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), num_splits)``; program ``(n, m, s)`` streams BLOCK_N
weight rows over the s-th of ``num_splits`` K ranges (whole K tiles, so whole scale groups),
software-pipelined (``num_stages``). What keeps the HBM busy is the bytes in flight: a layer whose
N tiles alone leave SMs idle (an 8B model's o_proj: 4,096 rows) is cut along K too, and the
splits' float32 partials are summed in split order by the last program of a tile to arrive
(split_k.py: one launch, and the same bits every run).

Layouts: x [M, K] (row stride any, inputs contiguous); FP8 weight e4m3 [N, K] row-major; 4-bit
weight int32 [N, K / 8] (input 8 i + j in nibble j of word i, ``quant_gemm.pack_w4a16``'s) with
zeros [N, K / group] in x's dtype; scale [cdiv(N, SCALE_ROWS), cdiv(K, group)]: per channel
(SCALE_ROWS 1, one group over K), per tensor (SCALE_ROWS N), 128 x 128 blocks (DeepSeek-V3's),
or W4A16 groups (SCALE_ROWS 1; a power of two from 8); partials [num_splits, M, N] float32.

Bytes: ``N K`` (FP8) or ``N K / 2`` (4-bit) of weights plus the scales (and zeros), and ``8
num_splits M N`` of partials; FLOPs ``2 M N K``. Launch parameters: ``default_launch``, from
``pagedllm bench quant --sweep``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel
from pagedllm.kernels.triton.split_k import arrival_counters, sum_splits_in_order

# The largest M this kernel is chosen for; above it the tensor-core GEMMs win (bench quant).
SKINNY_MAX_M = 16


# 2**23 as a float: a nibble OR-ed into its low mantissa bits reads as 2**23 + q.
_MAGIC_BITS = tl.constexpr(0x4B000000)
_MAGIC = tl.constexpr(8388608.0)


@triton.jit
def _dot_tile(
    x_rows, w_rows, scale_ptr, zero_ptr, k0, K, mask_m, mask_n, scale_rows, stride_sn, row_zero,
    INT4: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One K tile's x @ w^T on the tensor cores, [BLOCK_M, BLOCK_N] float32; w dequantized in
    registers as [BLOCK_N, BLOCK_K] (2-D loads: a 3-D tile reshaped for the MMA costs a layout
    conversion through shared memory)."""
    k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_rows[:, None] + k[None, :], mask=mask_m[:, None] & (k < K)[None, :], other=0.0)
    if INT4:
        # BLOCK_K / 8 words per row, each read once; its nibbles fan out in registers.
        words_k = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(
            w_rows[:, None] + words_k[None, :], mask=mask_n[:, None] & (words_k < K // 8)[None, :], other=0
        )
        nibbles = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
        w = tl.reshape(nibbles, (BLOCK_N, BLOCK_K)).to(tl.float32)  # word i, nibble j: input 8 i + j
    else:
        w = tl.load(w_rows[:, None] + k[None, :], mask=mask_n[:, None] & (k < K)[None, :], other=0.0)
    if GROUP > 0:  # BLOCK_K / GROUP groups in the tile: w = (q - z) s per group
        groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        at = scale_rows[:, None] * stride_sn + groups[None, :]
        in_range = mask_n[:, None] & (groups < tl.cdiv(K, GROUP))[None, :]
        w3 = tl.reshape(w.to(tl.float32), (BLOCK_N, BLOCK_K // GROUP, GROUP))
        if INT4:
            w3 -= tl.load(zero_ptr + at, mask=in_range, other=0.0).to(tl.float32)[:, :, None]
        w3 *= tl.load(scale_ptr + at, mask=in_range, other=0.0).to(tl.float32)[:, :, None]
        w = tl.reshape(w3, (BLOCK_N, BLOCK_K))
    elif INT4:
        w -= row_zero[:, None]  # small integers: exact in 16 bits
    # e4m3 and small integers widen to bf16/fp16 exactly; scaled groups round once, here.
    return tl.dot(x, tl.trans(w.to(x.dtype)), out_dtype=tl.float32, input_precision=PRECISION)


@triton.jit
def _fma_tile(
    x_rows, w_rows, scale_ptr, zero_ptr, k0, K, mask_m, mask_n, scale_rows, stride_sn, row_zero,
    INT4: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One K tile's products x[m, k] * w[n, k]: FP8 (one scale per row, applied by the caller),
    [BLOCK_M, BLOCK_N, BLOCK_K] float32; 4-bit, summed over each word's 8 inputs 8 i .. 8 i + 7,
    scaled, [BLOCK_M, BLOCK_N, BLOCK_K / 8].

    4-bit words are taken a nibble plane at a time (plane j: input 8 i + j of every word i, in the
    words' own register layout: no layout conversion). Nibble j < 5 is masked in place, where it
    sits inside the 23 mantissa bits: ``(word & 0xF << 4 j) | bits(2**23)`` is the float 2**23 +
    q 16**j, so one LOP3 and one FADD make q 16**j exactly, and x is scaled by 16**-j instead (exact,
    once per input, not per weight); nibbles 5..7 the same from ``word >> 20``. Zero points and
    scales apply per word, not per weight: sum x (q - z) s = s (sum x q - z sum x)."""
    if INT4:
        word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        in_k = word * 8 < K
        in_range = mask_n[:, None] & in_k[None, :]
        words = tl.load(w_rows[:, None] + word[None, :], mask=in_range, other=0)
        high = words >> 20  # nibbles 5, 6, 7 at bits 0, 4, 8
        x_sum = tl.zeros((x_rows.shape[0], BLOCK_K // 8), dtype=tl.float32)
        acc = tl.zeros((x_rows.shape[0], words.shape[0], BLOCK_K // 8), dtype=tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(
                x_rows[:, None] + (word * 8 + j)[None, :], mask=mask_m[:, None] & in_k[None, :], other=0.0
            )
            xj = xj.to(tl.float32)
            x_sum += xj
            if j < 5:
                q = ((words & (0xF << (4 * j))) | _MAGIC_BITS).to(tl.float32, bitcast=True) - _MAGIC
                acc += (xj * (1.0 / (16**j)))[:, None, :] * q[None, :, :]
            else:
                q = ((high & (0xF << (4 * (j - 5)))) | _MAGIC_BITS).to(tl.float32, bitcast=True) - _MAGIC
                acc += (xj * (1.0 / (16 ** (j - 5))))[:, None, :] * q[None, :, :]
        if GROUP > 0:  # a word's 8 inputs share a group: one scale and zero per word
            at = scale_rows[:, None] * stride_sn + (word * 8 // GROUP)[None, :]
            zero = tl.load(zero_ptr + at, mask=in_range, other=0.0).to(tl.float32)
            acc = (acc - x_sum[:, None, :] * zero[None, :, :]) * tl.load(
                scale_ptr + at, mask=in_range, other=0.0
            ).to(tl.float32)[None, :, :]
        else:
            acc -= x_sum[:, None, :] * row_zero[None, :, None]
    else:  # e4m3 [BLOCK_N, BLOCK_K], one scale per row (applied at the end)
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows[:, None] + k[None, :], mask=mask_n[:, None] & (k < K)[None, :], other=0.0)
        x = tl.load(x_rows[:, None] + k[None, :], mask=mask_m[:, None] & (k < K)[None, :], other=0.0)
        acc = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, partials_ptr, counters_ptr,
    M, N, K, SCALE_ROWS, k_per_split, num_splits,
    stride_xm, stride_wn, stride_sn, stride_om, stride_ps,
    INT4: tl.constexpr, GROUP: tl.constexpr, DOT: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    # GROUP: inputs per scale group, a power of two from 8 dividing BLOCK_K; 0: one group over K.
    wait_for_prior_kernel(USE_GDC)
    # Programs along N first: neighbouring programs stream neighbouring weight rows.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    scale_rows = offs_n // SCALE_ROWS
    row_zero = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if GROUP == 0:  # one scale (and 4-bit zero) per row, applied once
        row_scale = tl.load(scale_ptr + scale_rows * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
        if INT4:
            row_zero = tl.load(zero_ptr + scale_rows * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
    k_start = 0
    k_end = K
    if SPLIT:
        k_start = tl.program_id(2) * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
    tile_args = (x_rows, w_rows, scale_ptr, zero_ptr)
    if DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            acc += _dot_tile(
                *tile_args, k0, K, mask_m, mask_n, scale_rows, stride_sn, row_zero,
                INT4, GROUP, BLOCK_N, BLOCK_K, PRECISION,
            )  # fmt: skip
    else:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 8 if INT4 else BLOCK_K), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            acc3 += _fma_tile(
                *tile_args, k0, K, mask_m, mask_n, scale_rows, stride_sn, row_zero, INT4, GROUP, BLOCK_K
            )  # fmt: skip
        acc = tl.sum(acc3, axis=2)
    if GROUP == 0:
        acc *= row_scale[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    last = True
    if SPLIT:
        partial_ptrs = partials_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        last, acc = sum_splits_in_order(acc, partial_ptrs, stride_ps, mask, counters_ptr + tile, num_splits)
    if last:
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# The most rows the FMA product takes: it does M FMAs per weight, the tensor cores' tile 16 for free.
FMA_MAX_M = 4


# Launches from the alternatives of ``pagedllm bench quant --sweep`` on an H200 (2026-11-28: 1, 4,
# 8 and 16 rows at Llama-3.1-8B's four layer shapes, each launch timed in a CUDA graph over weight
# copies that miss L2; benchmarks/results/h200_2026-11-28_skinny_sweep.json). One row: the FMA
# product in single-warp programs of 4 rows x 1,024 inputs (FP8 per channel: 13.7, 8.8, 47.8,
# 25.1 us at qkv, o, gate_up, down against bf16's 16.5, 13.3, 60.1, 34.0; 4-bit: 21.1, 12.9,
# 72.2, 39.3). More rows: FP8 on the tensor cores, 32 x 128 tiles with K cut in two (a layer at
# 11-52 us from 4 to 16 rows); 4-bit with the FMA product to 4 rows (8 x 1,024, two warps), then
# on the tensor cores with K in four.
def default_launch(m: int, n: int, k: int, int4: bool) -> dict[str, int]:
    """The launch parameters for ``m`` rows of an [N, K] weight (``launch=`` overrides): ``block_n``,
    ``block_k``, ``num_warps``, ``num_stages``, ``fma`` (1: the FMA product, 0: DOT) and
    ``num_splits`` (K ranges; fewer where K has fewer tiles)."""
    if m == 1:
        return {"block_n": 4, "block_k": 1024, "num_warps": 1, "num_stages": 3, "fma": 1, "num_splits": 1}
    if int4 and m <= FMA_MAX_M:
        return {"block_n": 8, "block_k": 1024, "num_warps": 2, "num_stages": 3, "fma": 1, "num_splits": 1}
    # A long K (down, 14,336) wants a deeper pipeline.
    stages = 5 if k >= 8192 else 3
    return {
        "block_n": 32,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": stages,
        "fma": 0,
        "num_splits": 4 if int4 else 2,
    }


def group_in_tile(group_k: int, k: int, block_k: int) -> tuple[int, int] | None:
    """(GROUP, BLOCK_K) for scale groups of ``group_k`` inputs: (0, block_k) where one group spans
    K; else groups of a power of two from 8 up, BLOCK_K widened to hold at least one. None: the
    kernel cannot take these groups."""
    if group_k >= k:
        return 0, block_k
    if group_k < 8 or group_k & (group_k - 1):
        return None
    return group_k, max(block_k, group_k)


def reserve(device: torch.device) -> None:
    """Make the split launches' arrival counters on ``device`` now (a layer calls it when its weights
    are processed), not inside a CUDA graph capture."""
    arrival_counters(device, 0)


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group_k: int,
    scale_rows: int = 1,
    zeros: torch.Tensor | None = None,
    launch: dict[str, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ W [N, K]^T -> [M, N] in x's dtype, W dequantized on the fly.

    ``weight``: e4m3 [N, K], or int32 [N, K / 8] packed nibbles (then ``zeros`` is required);
    ``scale``: [cdiv(N, scale_rows), cdiv(K, group_k)] (the module doc's layouts); ``launch``
    overrides entries of ``default_launch``'s choice."""
    m, k = x.shape
    int4 = weight.dtype == torch.int32
    n = weight.shape[0]
    launch = default_launch(m, n, k, int4) | (launch or {})
    if int4:
        assert zeros is not None and zeros.shape == scale.shape and zeros.stride() == scale.stride()
        assert weight.shape[1] * 8 == k, f"packed weight {tuple(weight.shape)} for K {k}"
    else:
        assert weight.dtype == torch.float8_e4m3fn and weight.shape[1] == k, f"weight {weight.dtype}"
    assert scale.shape == (-(-n // scale_rows), -(-k // group_k)), f"scale {tuple(scale.shape)}"
    assert weight.stride(1) == 1 and scale.stride(1) == 1
    x = x if x.stride(1) == 1 else x.contiguous()
    tiling = group_in_tile(group_k, k, launch["block_k"])
    assert tiling is not None, f"groups of {group_k} inputs: the kernel takes powers of two from 8"
    group, block_k = tiling
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    fma = bool(launch["fma"]) and (int4 or group == 0)  # FP8 in blocks: DOT (scales per tile)
    # DOT: the tensor cores' least M (rows past M are masked, free at the weight-read bound).
    block_m = min(triton.next_power_of_2(m), FMA_MAX_M) if fma else 16
    k_tiles = triton.cdiv(k, block_k)
    k_per_split = triton.cdiv(k_tiles, min(launch["num_splits"], k_tiles)) * block_k
    num_splits = triton.cdiv(k, k_per_split)  # the same ranges, none empty
    grid = (triton.cdiv(n, launch["block_n"]), triton.cdiv(m, block_m), num_splits)
    split = num_splits > 1
    partials = torch.empty((num_splits, m, n), dtype=torch.float32, device=x.device) if split else out
    counters = arrival_counters(x.device, grid[0] * grid[1]) if split else out
    _skinny_kernel[grid](
        x, weight, scale, zeros if int4 else scale, out, partials, counters,
        m, n, k, scale_rows, k_per_split, num_splits,
        x.stride(0), weight.stride(0), scale.stride(0), out.stride(0), partials.stride(0) if split else 0,
        INT4=int4, GROUP=group, DOT=not fma, SPLIT=split,
        BLOCK_M=block_m, BLOCK_N=launch["block_n"], BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # ignored for 16-bit inputs
        num_warps=launch["num_warps"], num_stages=launch["num_stages"], **pdl_options(x.device),
    )  # fmt: skip
    return out
