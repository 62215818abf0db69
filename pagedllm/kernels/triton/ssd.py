"""Mamba-2's decode step: the state space dual's one-token update (Dao and Gu, "Transformers are
SSMs", ICML 2024), read and written in place at each sequence's row of the state cache; the conv
in front of it is in causal_conv1d.py (channels in order: x, then B, then C).

``ssd_state_update``, per head with a time step dt > 0 (after softplus) and A = -exp(A_log) < 0,
its state h [head_dim, d_state], and B, C [d_state] of the head's group::

    h = exp(dt A) h + (dt x) B^T          y = h C + D x          (layers/linear_attention/ssd.py)

Grid ``(batch, num_heads, cdiv(head_dim, BLOCK_P))``; a program owns a ``[BLOCK_P, d_state]`` tile
of one head's state (float32 in registers): whole rows of d_state, one contiguous run of memory,
the output's product reduced along a row. It reads the tile once and writes it once, plus a
token's x (BLOCK_P), B and C (d_state each) and dt. Bytes per sequence and head ~ 2 head_dim
d_state element_size, FLOPs ~ 5 head_dim d_state: memory bound at the state's read and write,
which is the floor of a recurrent decode step.

Layouts: x ``[batch, num_heads, head_dim]``, B and C ``[batch, n_groups, d_state]`` (each group
serving ``num_heads / n_groups`` consecutive heads), last dimensions contiguous, any other strides
(views of the conv's output); dt ``[batch, num_heads]`` float32, any strides; A_log, D
``[num_heads]``; state ``[num_rows, num_heads, head_dim, d_state]`` contiguous. ``slots`` [batch]:
rows of the state (-1: the last row, the scratch row of a CUDA graph's padding); ``has_state``
[batch]: False for a sequence at its first token, whose row is read as zeros whatever it holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel
from pagedllm.kernels.triton.state_rows import cache_row

# State elements a program owns ([BLOCK_P, d_state]) and its warps: the delta rule's tile
# (linear_attention.py), measured there (32 rows of 128 on one warp), whose rows are also whole runs
# of the state's last dimension; not yet swept at Mamba-2's shapes.
SSD_TILE = 4096
SSD_WARPS = 1


@triton.jit
def _ssd_update_kernel(
    out_ptr,
    x_ptr,
    b_ptr,
    c_ptr,
    dt_ptr,
    a_log_ptr,
    d_ptr,
    state_ptr,
    slots_ptr,
    has_state_ptr,
    num_rows,
    heads_per_group,
    stride_x_b,
    stride_x_h,
    stride_b_b,
    stride_b_g,
    stride_c_b,
    stride_c_g,
    stride_dt_b,
    stride_dt_h,
    stride_out_b,
    stride_out_h,
    stride_state_slot,
    stride_state_h,
    stride_state_p,
    D_P: tl.constexpr,
    D_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p, mask_n = offs_p < D_P, offs_n < D_N
    # The state's load first: it is the program's bytes; the rest is a few hundred.
    row = state_ptr + cache_row(slots_ptr, b, num_rows, stride_state_slot)
    keep = tl.load(has_state_ptr + b) != 0
    tile = row + h * stride_state_h + offs_p[:, None] * stride_state_p + offs_n[None, :]
    mask = mask_p[:, None] & mask_n[None, :]
    state = tl.load(tile, mask=mask, other=0.0)
    g = h // heads_per_group
    x = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + offs_p, mask=mask_p, other=0.0).to(tl.float32)
    B = tl.load(b_ptr + b * stride_b_b + g * stride_b_g + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    C = tl.load(c_ptr + b * stride_c_b + g * stride_c_g + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + b * stride_dt_b + h * stride_dt_h).to(tl.float32)
    decay = tl.exp(dt * -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)))
    state = tl.where(keep, state.to(tl.float32), 0.0) * decay + (dt * x)[:, None] * B[None, :]
    y = tl.sum(state * C[None, :], axis=1) + tl.load(d_ptr + h).to(tl.float32) * x
    tl.store(tile, state.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(
        out_ptr + b * stride_out_b + h * stride_out_h + offs_p, y.to(out_ptr.dtype.element_ty), mask=mask_p
    )


def ssd_state_update(
    x: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
) -> torch.Tensor:
    """x: [batch, num_heads, head_dim]; B, C: [batch, n_groups, d_state]; dt: [batch, num_heads]
    (after softplus); A_log, D: [num_heads]; state: [num_rows, num_heads, head_dim, d_state]
    contiguous, updated in place; slots: [batch] int; has_state: [batch] bool (layouts in the
    module doc). Returns y [batch, num_heads, head_dim] in x's dtype."""
    batch, num_heads, head_dim = x.shape
    n_groups, d_state = B.shape[1:]
    assert num_heads % n_groups == 0 and C.shape == B.shape == (batch, n_groups, d_state), (B.shape, C.shape)
    assert dt.shape == (batch, num_heads) and A_log.shape == D.shape == (num_heads,), (dt.shape, D.shape)
    assert x.stride(2) == B.stride(2) == C.stride(2) == 1, "unexpected layout"
    assert state.is_contiguous() and state.shape[1:] == (num_heads, head_dim, d_state), state.shape
    out = torch.empty(batch, num_heads, head_dim, dtype=x.dtype, device=x.device)
    if batch == 0:
        return out
    block_n = triton.next_power_of_2(d_state)
    block_p = min(triton.next_power_of_2(head_dim), max(1, SSD_TILE // block_n))
    grid = (batch, num_heads, triton.cdiv(head_dim, block_p))
    _ssd_update_kernel[grid](
        out, x, B, C, dt, A_log, D, state, slots, has_state,
        state.shape[0], num_heads // n_groups,
        x.stride(0), x.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        dt.stride(0), dt.stride(1), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        D_P=head_dim, D_N=d_state, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=SSD_WARPS,
        **pdl_options(x.device),
    )  # fmt: skip
    return out
