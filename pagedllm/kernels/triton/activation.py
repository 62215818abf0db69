"""SwiGLU's gate (Shazeer 2020): ``silu(gate) * up`` for ``x = [gate | up]``, in one pass.

Algorithm, elementwise with the torch path's rounding (``F.silu(gate).mul_(up)``)::

    act = (gate / (1 + exp(-gate))).to(dtype)          # float32 math, rounded like F.silu's output
    out = act * up                                     # float32 product, rounded to the dtype

Unfused, torch reads the gate, writes silu's output, then reads it back with ``up``; here the gate
and up halves are read once and the output written once.

Grid: ``(num_tokens, cdiv(d, BLOCK_D))``. Each program computes ``BLOCK_D`` outputs of one token
from the matching columns of its two halves.

Layouts: x ``[num_tokens, 2 * d]`` (MergedColumnParallelLinear's output), any row stride, columns
contiguous; out ``[num_tokens, d]``, same.

Bound: memory. Bytes ``3 * num_tokens * d * element_size``; ~5 FLOPs and one exp per output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,
    x_ptr,
    d,
    stride_x_tok,
    stride_o_tok,
    BLOCK_D: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < d
    dtype = x_ptr.dtype.element_ty
    gate_ptrs = x_ptr + token * stride_x_tok + offs
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + d, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    tl.store(
        out_ptr + token * stride_o_tok + offs,
        (act.to(tl.float32) * up).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2 * d] -> ``silu(x[..., :d]) * x[..., d:]``: [..., d], written to ``out`` (allocated
    when None) and returned."""
    assert x.shape[-1] % 2 == 0, f"the last dimension ({x.shape[-1]}) must hold gate and up halves"
    d = x.shape[-1] // 2
    if out is None:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    assert out.shape == (*x.shape[:-1], d) and out.dtype == x.dtype, f"out {tuple(out.shape)} {out.dtype}"
    # [num_tokens, ...]: views for the 2-D tensors the model passes (a copy only for odd layouts).
    x2, out2 = x.reshape(-1, 2 * d), out.view(-1, d)
    assert x2.stride(-1) == 1 and out2.stride(-1) == 1, "the last dimension must be contiguous"
    num_tokens = x2.shape[0]
    if num_tokens == 0 or d == 0:
        return out
    # 1024 columns: 8 per thread at the default 4 warps (16-byte vectors at 16 bits).
    block_d = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block_d))](
        out2,
        x2,
        d,
        x2.stride(0),
        out2.stride(0),
        BLOCK_D=block_d,
        **pdl_options(x.device),
    )
    return out
