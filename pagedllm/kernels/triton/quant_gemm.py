"""GEMMs over quantized weights: W4A16 (4-bit integer weights in groups, 16-bit activations) and
FP8 block-scaled W8A8 (DeepSeek-V3's format), ``out = x W^T``.

W4A16 above the few-token kernel's rows (skinny_gemm.py) is dequantize-then-GEMM, as vLLM's AWQ
path does from 256 tokens: one kernel writes the layer's weight in x's dtype, then cuBLAS
multiplies at the tensor cores' rate. The dequantization's traffic (2.5 bytes per weight) costs
7% at 4,096 tokens (H200, Llama-3.1-8B's gate_up: 1.37 ms against bf16's 1.28) and about 3x bf16's
time from 17 to 64 tokens (188 us against 65), where a fused 4-bit product would pay off; the
fused Triton GEMM this replaced ran at 13 TFLOP/s (76 ms at 4,096 tokens). Its kernel::

    grid (cdiv(N, BLOCK_N), cdiv(K / 8, BLOCK_WORDS)); a program: BLOCK_N rows x BLOCK_WORDS words
    q = (qweight[n, i] >> 4 j) & 0xF                                # input 8 i + j
    w[n, 8 i + j] = (q - zeros[n, 8 i // G]) * scales[n, 8 i // G]  # float32, rounded once

FP8 block-scaled (``x`` quantized per token group of ``block_k`` by the wrapper)::

    for each K tile (one block of block_k inputs):
        acc += (x_fp8 @ w_fp8^T) * x_scale[m, kb] * w_scale[n // block_n, kb]

FP8 block grid: ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))``; a program computes a BLOCK_M x BLOCK_N
tile of ``out`` over all of K.

Layouts: x [M, K] row-major (any row stride); W4A16 qweight int32 [N, K / 8] (nibble j of word i
is input 8 i + j), scales and zeros [N, K / G] in x's dtype (zeros as values, 0..15 in the
nibbles' offset; G a multiple of 8); FP8 weight e4m3 [N, K], weight_scale float32 [cdiv(N, bn),
cdiv(K, bk)].

Bound: the dequantization reads ``N K / 2`` bytes of weights plus ``4 N K / G`` of scales and zeros
and writes ``2 N K``; FP8 reads ``N K`` bytes. FLOPs ``2 M N K``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedllm.kernels.triton.gemm_tile import output_tile

FP8_MAX = 448.0
# The kernels' copies (a jitted function reads only constexpr globals); the zero-scale floor is
# torch.finfo(torch.float32).eps, fp8_utils' DYNAMIC_SCALE_FLOOR.
_FP8_MAX = tl.constexpr(FP8_MAX)
_SCALE_FLOOR = tl.constexpr(1.1920928955078125e-07)


@triton.jit
def _w4a16_dequantize_kernel(
    qweight_ptr, scales_ptr, zeros_ptr, out_ptr, N, WORDS, GROUP_SIZE, stride_qn, stride_sn, stride_on,
    BLOCK_N: tl.constexpr, BLOCK_WORDS: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_i = tl.program_id(1) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
    offs_j = tl.arange(0, 8)
    rows = offs_n[:, None].to(tl.int64)
    mask = (offs_n < N)[:, None] & (offs_i < WORDS)[None, :]
    words = tl.load(qweight_ptr + rows * stride_qn + offs_i[None, :], mask=mask, other=0)
    at = rows * stride_sn + (offs_i * 8 // GROUP_SIZE)[None, :]  # a word's 8 inputs share a group
    scale = tl.load(scales_ptr + at, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(zeros_ptr + at, mask=mask, other=0.0).to(tl.float32)
    # 2**23 + q: the nibble in the low mantissa bits of 2**23, with no int -> float conversion
    # (skinny_gemm.py); subtracting 2**23 + z leaves q - z exactly.
    q = (((words[:, :, None] >> (offs_j * 4)[None, None, :]) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    w = (q - (zero + 8388608.0)[:, :, None]) * scale[:, :, None]
    k = offs_i[:, None] * 8 + offs_j[None, :]
    tl.store(
        out_ptr + rows[:, :, None] * stride_on + k[None, :, :],
        w.to(out_ptr.dtype.element_ty),
        mask=mask[:, :, None],
    )


def pack_w4a16(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] integers in 0..15 (K a multiple of 8) -> int32 [N, K / 8], input 8 i + j in
    nibble j of word i (the kernel's layout)."""
    n, k = q.shape
    nibbles = q.to(torch.int64).view(n, k // 8, 8) << (4 * torch.arange(8, device=q.device))
    words = nibbles.sum(-1)  # disjoint bits: the sum is the OR
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def w4a16_fits(group_size: int, k: int) -> bool:
    """Whether the W4A16 kernels take these groups (each packed word's 8 inputs in one group)."""
    return group_size % 8 == 0 and k % 8 == 0


def dequantize_w4a16(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The [N, K] weight in ``dtype`` from its packed nibbles, scales and zeros (module doc)."""
    n, words = qweight.shape
    k = words * 8
    assert w4a16_fits(group_size, k), f"group_size {group_size} and K {k}: groups of a multiple of 8"
    assert qweight.dtype == torch.int32 and qweight.stride(1) == 1, f"qweight {qweight.dtype}"
    assert scales.shape == zeros.shape == (n, k // group_size) and scales.stride() == zeros.stride()
    assert scales.stride(1) == 1
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_n, block_words = 16, 64
    grid = (triton.cdiv(n, block_n), triton.cdiv(words, block_words))
    _w4a16_dequantize_kernel[grid](
        qweight, scales, zeros, out, n, words, group_size, qweight.stride(0), scales.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_WORDS=block_words,
    )  # fmt: skip
    return out


def w4a16_gemm(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x [M, K] @ dequantized W [N, K]^T -> [M, N] in x's dtype (layouts in the module doc)."""
    assert x.shape[1] == qweight.shape[1] * 8, f"x {tuple(x.shape)} for packed {tuple(qweight.shape)}"
    return F.linear(x, dequantize_w4a16(qweight, scales, zeros, group_size, x.dtype))


@triton.jit
def _fp8_block_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    M,
    N,
    K,
    BLOCK_SIZE_N,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_wsn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m, offs_n, offs_k, mask_m, mask_n = output_tile(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    w_block_rows = offs_n // BLOCK_SIZE_N  # each row's scale block
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        mask_k = k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + k[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        )
        x_scale = tl.load(x_scale_ptr + offs_m * stride_xsm + kb, mask=mask_m, other=0.0)
        w_scale = tl.load(w_scale_ptr + w_block_rows * stride_wsn + kb, mask=mask_n, other=0.0)
        acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32) * x_scale[:, None] * w_scale[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _fp8_quant_kernel(
    x_ptr, q_ptr, scale_ptr, K, GROUP, stride_xm, stride_qm, stride_sm, BLOCK: tl.constexpr
):  # fmt: skip
    """Grid ``(M, cdiv(K, GROUP))``: program (m, g) rounds inputs ``[g GROUP, (g + 1) GROUP)`` of
    row m (the last group ragged) to e4m3 under their dynamic scale: one pass for the amax, one to
    quantize (the row re-read from L1/L2). Reads 2 bytes and writes 1 per input (plus a float32
    scale per group), in one launch where the torch ops would take six."""
    m = tl.program_id(0)
    start = tl.program_id(1) * GROUP
    end = tl.minimum(start + GROUP, K)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(start, end, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + m * stride_xm + k, mask=k < end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # amax / 448 correctly rounded, as torch divides ("/" by a constant may multiply by its
    # rounded reciprocal, an ulp off); rounding is monotonic, so the max of the quotients is it.
    scale = tl.max(tl.math.div_rn(amax, tl.full((BLOCK,), _FP8_MAX, tl.float32)), axis=0)
    scale = tl.where(scale == 0.0, _SCALE_FLOOR, scale)  # a zero group stays zero
    tl.store(scale_ptr + m * stride_sm + tl.program_id(1), scale)
    for k0 in range(start, end, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + m * stride_xm + k, mask=k < end, other=0.0).to(tl.float32)
        # x / s correctly rounded (div_rn: Triton's "/" is the approximate division), as torch divides.
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_FP8_MAX), _FP8_MAX)
        tl.store(q_ptr + m * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=k < end)


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, cdiv(K, group)]), each ``group`` inputs of a
    token (the last group ragged; ``group >= K``: per token) under ``amax / 448`` (the CPU path's
    rounding: layers/quantization/fp8_utils.py)."""
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    num_groups = triton.cdiv(k, group)
    if x.device.type != "cuda":
        # Triton's interpreter converts float32 to e4m3 unlike a GPU (through float16; some values
        # land a binade off): the CPU (tests forcing the CUDA layouts) rounds with torch.
        width = min(group, k)
        groups = torch.nn.functional.pad(x.float(), (0, -k % width)).view(m, num_groups, width)
        scale = groups.abs().amax(-1) / FP8_MAX
        scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
        q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.view(m, -1)[:, :k].contiguous(), scale
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, num_groups, dtype=torch.float32, device=x.device)
    block = min(1024, triton.next_power_of_2(min(group, k)))
    _fp8_quant_kernel[(m, num_groups)](
        x, q, scale, k, group, x.stride(0), q.stride(0), scale.stride(0), BLOCK=block
    )
    return q, scale


# K tiles the FP8 block GEMM takes: one scale block a tile, and a GPU's FP8 MMA needs K >= 32 (the
# interpreter, which the CPU tests run under, takes 16 too).
FP8_BLOCK_K = (32, 64, 128)


def fp8_block_fits(block_k: int, k: int) -> bool:
    """Whether the FP8 block GEMM takes a weight of K inputs in scale blocks of ``block_k``."""
    return block_k in FP8_BLOCK_K and k % block_k == 0


def fp8_block_gemm(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """x [M, K] (model dtype) @ block-scaled e4m3 W [N, K]^T -> [M, N] in x's dtype; x is rounded
    per token group of ``block[1]`` first, as the format's activations are."""
    block_n, block_k = block
    m, k = x.shape
    n = weight.shape[0]
    interpreted = x.device.type == "cpu" and block_k == 16
    assert fp8_block_fits(block_k, k) or interpreted, f"K {k} and block_k {block_k}"
    assert weight.dtype == torch.float8_e4m3fn and weight.stride(1) == 1 and weight_scale.stride(1) == 1
    x_fp8, x_scale = quantize_per_token_group(x, block_k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    tile_n = min(64, block_n)  # inside one scale block of rows, or several whole ones
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, tile_n))
    _fp8_block_kernel[grid](
        x_fp8, x_scale, weight, weight_scale, out, m, n, k, block_n,
        x_fp8.stride(0), x_scale.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=tile_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out
