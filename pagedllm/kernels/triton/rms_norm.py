"""RMSNorm, optionally fused with the residual add before it, in one pass over each row.

Algorithm (Zhang & Sennrich 2019), row by row, in one of two roundings (``GEMMA``)::

    s   = x + residual                                           # rounded to the input dtype, as torch adds
    out = (s * rsqrt(mean(s^2) + eps)).to(dtype) * weight        # Llama's (HF's LlamaRMSNorm)
    out = (s * rsqrt(mean(s^2) + eps) * (1 + weight)).to(dtype)  # Gemma's (HF's GemmaRMSNorm)

The statistics are float32 in both. Llama's order casts the normalized row back to the input dtype
*before* the weight multiplies it; Gemma's (also Qwen3-Next's) stores the weight as its offset from
1 and takes the product in float32, rounding once at the end. In bf16 the two orders round
differently, and each model's logits match the reference's only in its own. Unfused, torch makes
five passes over the row (add, square-and-mean, scale, cast, weight); here each input is read once
and each result written once.

Grid: ``(cdiv(num_rows, BLOCK_R),)``. Each program owns ``BLOCK_R`` consecutive rows of
``HIDDEN_SIZE`` elements (one row from 2,048 elements up, 16 rows of 128), loaded whole as a
``[BLOCK_R, BLOCK_N]`` tile (``HIDDEN_SIZE`` rounded up to a power of two, the tail and the rows
past the end masked): rows are at most a few thousand elements, which fit in registers, so there
is no second loop over a row.

Layouts: x, residual and out are ``[outer, inner, hidden_size]`` with any strides but a contiguous
last dimension; a row is addressed by two strides so that a ``[num_tokens, num_heads, head_size]``
view of the fused QKV output (the per-head q/k norms of Qwen3, Qwen3-Next and Gemma 3) is read
where it lies, with no copy. weight ``[hidden_size]``. With a residual, ``s`` is written over
``residual`` and ``out`` over ``x`` (vLLM's ``fused_add_rms_norm`` contract): the decoder layer is
done with both, so the step needs no new buffers.

Bound: memory. Bytes per row ``(2 + 2 * has_residual) * hidden_size * element_size`` (+ the
weight, cached); ~4 FLOPs per element in either order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel

# Elements a program normalizes: rows shorter than this are packed several to a program.
_ELEMENTS_PER_PROGRAM = 2048


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    num_rows,
    num_inner,
    eps,
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    stride_o_outer,
    stride_o_inner,
    HIDDEN_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    GEMMA: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    # int64: row * stride overflows int32 past 2^31 elements (long prefills of wide models).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    outer = rows // num_inner
    inner = rows % num_inner
    offs = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < num_rows) & (offs[None, :] < HIDDEN_SIZE)
    dtype = x_ptr.dtype.element_ty

    x_ptrs = x_ptr + (outer * stride_x_outer + inner * stride_x_inner)[:, None] + offs[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_rows = outer * stride_r_outer + inner * stride_r_inner
        residual_ptrs = residual_ptr + residual_rows[:, None] + offs[None, :]
        residual = tl.load(residual_ptrs, mask=mask, other=0.0)
        # Round the sum to the input dtype first: torch's ``x + residual`` does, and both the norm
        # and the next layer's residual stream start from the rounded value.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        tl.store(residual_ptrs, x, mask=mask)

    x_fp32 = x.to(tl.float32)
    variance = tl.sum(x_fp32 * x_fp32, 1) / HIDDEN_SIZE
    normed = x_fp32 * tl.math.rsqrt(variance + eps)[:, None]
    weight = tl.load(weight_ptr + offs, mask=offs < HIDDEN_SIZE, other=0.0).to(tl.float32)
    # The reference's rounding in each order: Gemma's rounds once, after the product; Llama's
    # rounds the normalized row to the input dtype before the weight multiplies it.
    if GEMMA:
        out = normed * (1.0 + weight)[None, :]
    else:
        out = normed.to(dtype).to(tl.float32) * weight[None, :]
    out_ptrs = out_ptr + (outer * stride_o_outer + inner * stride_o_inner)[:, None] + offs[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    *,
    gemma: bool = False,
) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension of x: [..., hidden_size];
    writes ``out`` (same shape and dtype, allocated when None) and returns it.

    ``gemma``: Gemma's ``(1 + weight)``, multiplied in float32 before the cast (the module
    docstring's two orders); otherwise Llama's ``weight``, multiplied after it.
    """
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == x.dtype, f"out {tuple(out.shape)} {out.dtype}"
    _launch(_as_3d(out), _as_3d(x), None, weight, eps, gemma)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``, written over x and residual respectively.

    x, residual: [..., hidden_size], same shape and dtype. Returns the two results as tensors of
    the input shapes (views of the inputs' buffers). ``gemma`` as for ``rms_norm``.
    """
    assert residual.shape == x.shape and residual.dtype == x.dtype, (
        f"residual {tuple(residual.shape)} {residual.dtype} vs x {tuple(x.shape)} {x.dtype}"
    )
    x3, residual3 = _as_3d(x), _as_3d(residual)
    _launch(x3, x3, residual3, weight, eps, gemma)
    # _as_3d copies only tensors of 4+ dims whose leading dims cannot be merged; returning the
    # buffers that were written keeps the result right even then.
    return x3.view(x.shape), residual3.view(residual.shape)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """[..., hidden_size] -> [outer, inner, hidden_size], a view (any strides) for 1 to 3 dims.

    [num_tokens, hidden_size] becomes [num_tokens, 1, hidden_size]: ``num_inner`` is then always
    1, a value Triton specializes on, so the model's 2-D calls share one compiled kernel.
    """
    if t.dim() <= 2:
        return t.reshape(-1, 1, t.shape[-1])
    return t.flatten(0, -3)


def _launch(
    out: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    gemma: bool,
) -> None:
    """out, x, residual: [outer, inner, hidden_size]; residual is updated in place when given."""
    hidden_size = x.shape[-1]
    assert weight.shape == (hidden_size,) and weight.stride(0) == 1, f"weight {tuple(weight.shape)}"
    # The row is loaded as one vector: its elements must be contiguous.
    assert x.stride(-1) == 1 and out.stride(-1) == 1, "hidden_size must be the contiguous dimension"
    assert residual is None or residual.stride(-1) == 1, "hidden_size must be the contiguous dimension"
    num_outer, num_inner = x.shape[:2]
    if num_outer * num_inner == 0:
        return
    num_rows = num_outer * num_inner
    block_n = triton.next_power_of_2(hidden_size)
    # Short rows (Qwen3's per-head norms: 128 elements, 16 heads per token) are packed several to
    # a program, about 2,048 elements each: one row per program would leave each program too
    # little work to hide its own start and a prefill's hundreds of thousands of them queueing.
    block_r = max(_ELEMENTS_PER_PROGRAM // block_n, 1)
    # Without a residual, x stands in for it: the kernel never touches it then.
    residual_arg = x if residual is None else residual
    _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
        out,
        x,
        residual_arg,
        weight,
        num_rows,
        num_inner,
        eps,
        *x.stride()[:2],
        *residual_arg.stride()[:2],
        *out.stride()[:2],
        HIDDEN_SIZE=hidden_size,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        HAS_RESIDUAL=residual is not None,
        GEMMA=gemma,
        # One warp per 256 elements (8 per thread: 16-byte vectors at 16 bits), 1 to 8 warps.
        num_warps=min(max(block_r * block_n // 256, 1), 8),
        **pdl_options(x.device),
    )
