"""Weight-only GEMM for few tokens (decode: M <= 16): FP8 (e4m3) or 4-bit integer weights times
16-bit activations, ``out = x W^T``, read at the HBM ceiling.

At M <= 16 a layer's product is a matrix-vector product in all but name: it does ``2 M`` FLOPs per
weight it reads, far below any GPU's FLOPs per byte, so its time is the weight's bytes over the
copy bandwidth. What costs there is everything else: ``torch._scaled_mm`` pads M to its tile and
needs the activations quantized by a kernel of their own first (a launch per layer), and the
W8A8/W4A16 GEMMs tile M for prefill. This kernel reads each weight byte once, converts it in
registers (e4m3 -> 16-bit is exact; ``q - z`` of 4-bit integers too), and keeps the activations
in their own dtype (W8A16 numerics: no activation rounding, so at least as accurate as W8A8).

    for each K tile (BLOCK_K inputs: BLOCK_K / GROUP whole scale groups, or any part of one
                     group spanning K):
        w    = e4m3 weights, or 4-bit nibbles - zero                        # in registers
        w    = w * scale[n // SCALE_ROWS, k // GROUP]  -> x's dtype         # grouped scales
        acc += x[m, k] @ w^T                                                # fp32
    out = acc (* the row's scale, where one group spans K)

Grid: ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))``; a program streams BLOCK_N weight rows over all of
K, software-pipelined (``num_stages``). What keeps the HBM busy is the bytes in flight: FP8 tiles
are 32 rows of 128-512 bytes (an 8B layer's N >= 4096 gives >= 128 programs); 4-bit tiles 16 or
32 rows of 128-256 inputs (groups of 128 sit inside a tile, their scales applied to the weights,
not the accumulator, so the tile is not cut to a group). No
split-K: it would need a zeroed fp32 output and a cast (two more launches per layer, more than
the tail it saves at these N); shards of N < 2048 (TP >= 4) would want it.

Layouts: x [M, K] (row stride any, inputs contiguous); FP8 weight e4m3 [N, K] row-major; 4-bit
weight int32 [N, K / 8] (input 8 i + j in nibble j of word i, ``quant_gemm.pack_w4a16``'s) with
zeros [N, K / group] in x's dtype; scale [cdiv(N, SCALE_ROWS), cdiv(K, group)]: per channel
(SCALE_ROWS 1, one group over K), per tensor (SCALE_ROWS N), 128 x 128 blocks (DeepSeek-V3's),
or W4A16 groups (SCALE_ROWS 1; a power of two from 8).

Bytes: ``N K`` (FP8) or ``N K / 2`` (4-bit) of weights plus the scales (and zeros); FLOPs ``2 M N
K``. Launch parameters: ``default_launch``, from ``pagedllm bench quant --sweep`` on an H100.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The largest M this kernel is chosen for; above it the tensor-core GEMMs win (bench quant).
SKINNY_MAX_M = 16


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, SCALE_ROWS,
    stride_xm, stride_wn, stride_sn, stride_om,
    INT4: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # GROUP: inputs per scale group, a power of two dividing BLOCK_K; 0: one group over K.
    # Programs along N first: neighbouring programs stream neighbouring weight rows.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    scale_rows = offs_n // SCALE_ROWS
    if GROUP == 0:  # a 4-bit row's zero point, loaded once (FP8: unused; zero_ptr is the scale's)
        row_zero = tl.load(zero_ptr + offs_n * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :],
            mask=mask_m[:, None] & (k < K)[None, :],
            other=0.0,
        )
        if INT4:
            # BLOCK_K / 8 words per row, each read once; its nibbles fan out in registers.
            words_k = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            words = tl.load(
                w_ptr + offs_n[:, None] * stride_wn + words_k[None, :],
                mask=mask_n[:, None] & (words_k < K // 8)[None, :],
                other=0,
            )
            nibbles = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
            w = tl.reshape(nibbles, (BLOCK_N, BLOCK_K)).to(tl.float32)  # word i, nibble j: input 8 i + j
        else:
            w = tl.load(
                w_ptr + offs_n[:, None] * stride_wn + k[None, :],
                mask=mask_n[:, None] & (k < K)[None, :],
                other=0.0,
            )
        if GROUP > 0:  # BLOCK_K / GROUP groups in the tile: w = (q - z) s per group, then 16-bit
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
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), out_dtype=tl.float32)
    if GROUP == 0:
        acc *= tl.load(scale_ptr + scale_rows * stride_sn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# Launches chosen from ``pagedllm bench quant --sweep`` at one token on an H100 (2026-11-27: 24
# launches at each of Llama-3.1-8B's four layer shapes; the rule picks the fastest at all four, or
# within 2%). FP8: 32 rows a program everywhere (16 left the HBM idle: 1.1-1.6x slower); a grid of
# >= 512 programs (gate_up) wants short K tiles, which keep more programs resident, and a long K
# (down, 14,336) a deeper pipeline. 4-bit: its dequantizing arithmetic, not HBM, bounds it: 16 rows
# and 256 inputs a tile, except for very wide N, where 32 x 128 wins.
_LAUNCH = {"num_warps": 4, "num_stages": 3}


def default_launch(n: int, k: int, int4: bool) -> dict[str, int]:
    """The launch parameters for an [N, K] weight (module doc's rule; ``launch=`` overrides)."""
    if int4:
        wide = triton.cdiv(n, 16) >= 1024
        return _LAUNCH | ({"block_n": 32, "block_k": 128} if wide else {"block_n": 16, "block_k": 256})
    block_k = 128 if triton.cdiv(n, 32) >= 512 else 512
    return _LAUNCH | {"block_n": 32, "block_k": block_k, "num_stages": 5 if k >= 8192 else 3}


def group_in_tile(group_k: int, k: int, block_k: int) -> tuple[int, int] | None:
    """(GROUP, BLOCK_K) for scale groups of ``group_k`` inputs: (0, block_k) where one group spans
    K; else groups of a power of two from 8 up, BLOCK_K widened to hold at least one. None: the
    kernel cannot take these groups."""
    if group_k >= k:
        return 0, block_k
    if group_k < 8 or group_k & (group_k - 1):
        return None
    return group_k, max(block_k, group_k)


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
    launch = default_launch(n, k, int4) | (launch or {})
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
    block_m = 16  # the tensor cores' least M; rows past M are masked (free at the weight-read bound)
    grid = (triton.cdiv(n, launch["block_n"]), triton.cdiv(m, block_m))
    _skinny_kernel[grid](
        x, weight, scale, zeros if int4 else scale, out, m, n, k, scale_rows,
        x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        INT4=int4, GROUP=group,
        BLOCK_M=block_m, BLOCK_N=launch["block_n"], BLOCK_K=block_k,
        num_warps=launch["num_warps"], num_stages=launch["num_stages"],
    )  # fmt: skip
    return out
