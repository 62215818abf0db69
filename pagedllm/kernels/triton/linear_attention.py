"""Gated DeltaNet's decode step and output norm. The step's kernel reads and writes each
sequence's state in place at its row of the state cache (no gather, no scatter); the conv in
front of it is in causal_conv1d.py.

``gated_delta_rule_update``: the gated delta rule's one-token step (Yang, Kautz and Hatamizadeh,
ICLR 2025), q and k l2-normalised in the kernel, q scaled by d_k ** -0.5, the gates computed in it
from the projections' raw outputs (``gdn_gates``: beta = sigmoid(b), g = -exp(A_log) softplus(a +
dt_bias)), so the layer launches nothing between the conv and this kernel::

    S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q          S: [d_k, d_v] per value head

The state is stored transposed, V-first: ``[d_v, d_k]`` per head (flash-linear-attention's
``state_v_first`` layout, which its chunked prefill reads and writes), so that a program's tile,
``BLOCK_V`` whole rows of d_k, is one contiguous run of memory, and both products, S^T k and
S^T q, reduce along a row, inside a warp.

Grid ``(batch, num_v_heads, cdiv(d_v, BLOCK_V))``; a program owns a ``[BLOCK_V, D_K]`` tile of one
head's state (float32 in registers), reads it once and writes it once: bytes per sequence and head
~ 2 d_k d_v element_size, FLOPs ~ 6 d_k d_v. Memory bound: the state is read and written once per
token, which is the floor. At W6's decode shape (256 sequences, 32 heads of 128 x 128, bf16,
state rows scattered) on an H200, timed in a CUDA graph: 151 us for the 537 MB, 3.55 TB/s, where
the K-first layout's best tile ([128, 64] with 4 warps, 128-byte runs) took 191 us.

``rms_norm_gated``: the layer's output norm, each head's row normalised and gated by silu(z) in
one pass (header at the function).

``l2_normalize_``: the prefill's q and k normalised per head in place before the chunked rule
(header at the function).

The step's kernel and the norm after it are launched with programmatic dependent launch where
the device has it (pdl.py), as are the conv's update and Mamba-2's step: a decode step of W6 is
some 300 kernels.

``has_state`` [batch]: False for a sequence at its first token, whose row is read as zeros
whatever it holds. Slots index rows of the state tensor (-1: the last row, the scratch row of a
CUDA graph's padding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel
from pagedllm.kernels.triton.state_rows import cache_row


@triton.jit
def _gated_delta_rule_update_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    slots_ptr,
    has_state_ptr,
    num_rows,
    group,
    scale,
    stride_q_b,
    stride_q_h,
    stride_k_b,
    stride_k_h,
    stride_v_b,
    stride_v_h,
    stride_a_b,
    stride_a_h,
    stride_b_b,
    stride_b_h,
    stride_out_b,
    stride_out_h,
    stride_state_slot,
    stride_state_h,
    stride_state_v,
    D_K: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < D_K, offs_v < D_V
    # The state's address first: its load, the program's 2 BLOCK_V d_k bytes, is the one to start
    # early; everything else is a few hundred bytes.
    row = state_ptr + cache_row(slots_ptr, b, num_rows, stride_state_slot)
    keep = tl.load(has_state_ptr + b) != 0
    tile = row + h * stride_state_h + offs_v[:, None] * stride_state_v + offs_k[None, :]
    mask = mask_v[:, None] & mask_k[None, :]
    state = tl.load(tile, mask=mask, other=0.0)
    key_head = h // group  # each key head serves `group` consecutive value heads
    j = h % group
    q = tl.load(q_ptr + b * stride_q_b + key_head * stride_q_h + offs_k, mask=mask_k, other=0.0).to(
        tl.float32
    )
    k = tl.load(k_ptr + b * stride_k_b + key_head * stride_k_h + offs_k, mask=mask_k, other=0.0).to(
        tl.float32
    )
    v = tl.load(v_ptr + b * stride_v_b + h * stride_v_h + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
    # The gates from the projections' raw outputs, as gdn_gates: beta = sigmoid(b), rounded to the
    # activations' dtype as the torch layer rounds it; g = -exp(A_log) softplus(a + dt_bias).
    raw_b = tl.load(b_ptr + b * stride_b_b + key_head * stride_b_h + j)
    beta = tl.sigmoid(raw_b.to(tl.float32)).to(raw_b.dtype).to(tl.float32)
    x = tl.load(a_ptr + b * stride_a_b + key_head * stride_a_h + j).to(tl.float32)
    x += tl.load(dt_bias_ptr + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's softplus, threshold 20
    g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus
    state = tl.where(keep, state.to(tl.float32), 0.0) * tl.exp(g)
    predicted = tl.sum(state * k[None, :], axis=1)  # S^T k: [BLOCK_V]
    state += (beta * (v - predicted))[:, None] * k[None, :]
    out = tl.sum(state * q[None, :], axis=1)
    tl.store(tile, state.to(state_ptr.dtype.element_ty), mask=mask)
    out_row = out_ptr + b * stride_out_b + h * stride_out_h
    tl.store(out_row + offs_v, out.to(out_ptr.dtype.element_ty), mask=mask_v)


def gated_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
) -> torch.Tensor:
    """q, k: [batch, num_k_heads, d_k]; v: [batch, num_v_heads, d_v]; a, b: [batch, num_k_heads,
    group] (the decay's and the write strength's raw projections, value head ``kh * group + j`` at
    ``[:, kh, j]``); last dimensions contiguous, any other strides (views of the projections' and the
    conv's outputs). A_log, dt_bias: [num_v_heads]. ssm_state: [num_rows, num_v_heads, d_v, d_k]
    contiguous (V-first), updated in place; slots: [batch] int64; has_state: [batch] bool. Returns o [batch,
    num_v_heads, d_v] in v's dtype."""
    batch, num_k_heads, d_k = q.shape
    num_v_heads, d_v = v.shape[1:]
    group = num_v_heads // num_k_heads
    assert a.shape == b.shape == (batch, num_k_heads, group), (a.shape, b.shape)
    assert q.stride(2) == k.stride(2) == v.stride(2) == a.stride(2) == b.stride(2) == 1, "unexpected layout"
    assert ssm_state.is_contiguous() and ssm_state.shape[1:] == (num_v_heads, d_v, d_k), ssm_state.shape
    out = torch.empty(batch, num_v_heads, d_v, dtype=v.dtype, device=q.device)
    block_k = triton.next_power_of_2(d_k)
    block_v = min(triton.next_power_of_2(d_v), max(1, DELTA_RULE_TILE // block_k))
    grid = (batch, num_v_heads, triton.cdiv(d_v, block_v))
    _gated_delta_rule_update_kernel[grid](
        out, q, k, v, a, b, A_log, dt_bias, ssm_state, slots, has_state,
        ssm_state.shape[0], group, d_k**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        D_K=d_k, D_V=d_v, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=DELTA_RULE_WARPS,
        **pdl_options(q.device),
    )  # fmt: skip
    return out


# State elements a delta-rule program owns ([BLOCK_V, d_k]), and its warps: at W6's decode shape
# (above), the fastest of 4 to 64 rows of 128 with 1 to 8 warps, timed in CUDA graphs: 32 rows on
# one warp, 151 us (64 rows: 152 to 163 us; 16 rows: 211 us). With 16 sequences: 8.9 us, against
# 8.3 for the best (16 rows), and the K-first layout's 11.7.
DELTA_RULE_TILE = 4096
DELTA_RULE_WARPS = 1


@triton.jit
def _rms_norm_gated_kernel(
    out_ptr,
    x_ptr,
    gate_ptr,
    weight_ptr,
    num_rows,
    num_v_heads,
    group,
    eps,
    stride_gate_t,
    stride_gate_kh,
    stride_gate_j,
    D_V: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_V)
    mask = (rows < num_rows)[:, None] & (cols < D_V)[None, :]
    x = tl.load(x_ptr + rows[:, None] * D_V + cols[None, :], mask=mask, other=0.0)
    token, h = rows // num_v_heads, rows % num_v_heads
    gate_row = token.to(tl.int64) * stride_gate_t + (h // group) * stride_gate_kh
    gate_row += (h % group) * stride_gate_j
    gate = tl.load(gate_ptr + gate_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=1) / D_V + eps)[:, None]
    weight = tl.load(weight_ptr + cols, mask=cols < D_V, other=0.0).to(tl.float32)
    # The torch layer's roundings: the normalised row to x's dtype, its product with the weight too.
    scaled = (normed.to(x.dtype).to(tl.float32) * weight[None, :]).to(x.dtype).to(tl.float32)
    out = scaled * gate * tl.sigmoid(gate)
    tl.store(out_ptr + rows[:, None] * D_V + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Gated DeltaNet's output norm: RMSNorm over each head's d_v features, times the weight, times
    silu(gate). x: [num_tokens, num_v_heads, d_v] contiguous; gate: [num_tokens, num_k_heads,
    group, d_v] (head ``kh * group + j`` at ``[:, kh, j]``; any strides, the last contiguous: a view
    of the projection's output); weight: [d_v]. Returns [num_tokens, num_v_heads * d_v] in x's
    dtype: ``out`` when given (contiguous, e.g. a slice of rows of a larger output, so that the
    decodes' and the prefill chunks' outputs are written into one buffer without a copy).

    Grid ``(cdiv(num_tokens * num_v_heads, BLOCK_R),)``: a program normalises ``BLOCK_R`` head rows
    (a row fits in registers). Bytes ~ 3 d_v element_size per row: memory bound."""
    num_tokens, num_v_heads, d_v = x.shape
    assert x.is_contiguous() and gate.stride(3) == 1, "unexpected layout"
    if out is None:
        out = torch.empty(num_tokens, num_v_heads * d_v, dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, num_v_heads * d_v) and out.dtype == x.dtype, (out.shape, out.dtype)
    assert out.is_contiguous(), "unexpected layout"
    num_rows = num_tokens * num_v_heads
    block_v = triton.next_power_of_2(d_v)
    block_r = max(1, 2048 // block_v)
    _rms_norm_gated_kernel[(triton.cdiv(num_rows, block_r),)](
        out, x, gate, weight, num_rows, num_v_heads, gate.shape[2], eps,
        gate.stride(0), gate.stride(1), gate.stride(2),
        D_V=d_v, BLOCK_V=block_v, BLOCK_R=block_r,
        **pdl_options(x.device),
    )  # fmt: skip
    return out


@triton.jit
def _l2_normalize_kernel(x_ptr, num_rows, eps, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (cols < D)[None, :]
    ptrs = x_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=1) + eps)[:, None]
    tl.store(ptrs, normed.to(x_ptr.dtype.element_ty), mask=mask)


def l2_normalize_(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension, in float32, written back into x (as
    ``gated_delta_rule.l2_normalize`` of x in float32, rounded to x's dtype). x: [..., d]
    contiguous. Returns x.

    Grid ``(cdiv(rows, BLOCK_R),)``: a program normalises ``BLOCK_R`` rows of d (a row fits in
    registers). Bytes 2 d element_size per row, one read and one write: memory bound, where the
    torch expression makes about eight passes (its float32 copy, square, sum, rsqrt, product,
    rounding). On an H200, 16,384 tokens of 16 heads of 128 in bf16: 34 us."""
    assert x.is_contiguous(), "unexpected layout"
    d = x.shape[-1]
    num_rows = x.numel() // d
    block_d = triton.next_power_of_2(d)
    block_r = max(1, 2048 // block_d)
    _l2_normalize_kernel[(triton.cdiv(num_rows, block_r),)](
        x, num_rows, eps, D=d, BLOCK_D=block_d, BLOCK_R=block_r
    )
    return x
