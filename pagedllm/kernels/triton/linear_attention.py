"""The gated delta rule's decode kernel: one token per sequence, state read and written in place
at each sequence's row of the state cache (no gather, no scatter). The conv in front of it is in
causal_conv1d.py.

``gated_delta_rule_update``: the gated delta rule's one-token step (Yang, Kautz and Hatamizadeh,
ICLR 2025), q and k l2-normalised in the kernel, q scaled by d_k ** -0.5::

    S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q          S: [d_k, d_v] per value head

Grid ``(batch, num_v_heads, cdiv(d_v, BLOCK_V))``; a program owns a ``[D_K, BLOCK_V]`` tile of one
head's state (float32 in registers, the whole d_k so that S^T k reduces in the program), reads it
once and writes it once: bytes per sequence and head ~ 2 d_k d_v element_size, FLOPs ~ 6 d_k d_v.
Memory bound: the state is read and written once per token, which is the floor.

``has_state`` [batch]: False for a sequence at its first token, whose row is read as zeros
whatever it holds. Slots index rows of the state tensor (-1: the last row, the scratch row of a
CUDA graph's padding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_delta_rule_update_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
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
    stride_gb_b,
    stride_out_b,
    stride_out_h,
    stride_state_slot,
    stride_state_h,
    stride_state_k,
    D_K: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < D_K, offs_v < D_V
    key_head = h // group  # each key head serves `group` consecutive value heads
    q = tl.load(q_ptr + b * stride_q_b + key_head * stride_q_h + offs_k, mask=mask_k, other=0.0).to(
        tl.float32
    )
    k = tl.load(k_ptr + b * stride_k_b + key_head * stride_k_h + offs_k, mask=mask_k, other=0.0).to(
        tl.float32
    )
    v = tl.load(v_ptr + b * stride_v_b + h * stride_v_h + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
    g = tl.load(g_ptr + b * stride_gb_b + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * stride_gb_b + h).to(tl.float32)
    slot = tl.load(slots_ptr + b)
    slot = tl.where(slot < 0, slot + num_rows, slot)
    keep = tl.load(has_state_ptr + b) != 0
    tile = (
        state_ptr
        + slot * stride_state_slot
        + h * stride_state_h
        + offs_k[:, None] * stride_state_k
        + offs_v[None, :]
    )
    mask = mask_k[:, None] & mask_v[None, :]
    state = tl.where(keep, tl.load(tile, mask=mask, other=0.0).to(tl.float32), 0.0) * tl.exp(g)
    predicted = tl.sum(state * k[:, None], axis=0)  # S^T k: [BLOCK_V]
    state += k[:, None] * (beta * (v - predicted))[None, :]
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(tile, state.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + b * stride_out_b + h * stride_out_h + offs_v, out, mask=mask_v)


def gated_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
) -> torch.Tensor:
    """q, k: [batch, num_k_heads, d_k]; v: [batch, num_v_heads, d_v] (last dimensions contiguous,
    any other strides: views of the conv's output); g, beta: [batch, num_v_heads] float32;
    ssm_state: [num_rows, num_v_heads, d_k, d_v] contiguous, updated in place; slots: [batch]
    int64; has_state: [batch] bool. Returns o [batch, num_v_heads, d_v] float32."""
    batch, num_k_heads, d_k = q.shape
    num_v_heads, d_v = v.shape[1:]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and ssm_state.is_contiguous(), "unexpected layout"
    assert ssm_state.shape[1:] == (num_v_heads, d_k, d_v), ssm_state.shape
    g, beta = g.float().contiguous(), beta.float().contiguous()
    out = torch.empty(batch, num_v_heads, d_v, dtype=torch.float32, device=q.device)
    block_k = triton.next_power_of_2(d_k)
    block_v = min(triton.next_power_of_2(d_v), max(16, 8192 // block_k))
    grid = (batch, num_v_heads, triton.cdiv(d_v, block_v))
    _gated_delta_rule_update_kernel[grid](
        out, q, k, v, g, beta, ssm_state, slots, has_state,
        ssm_state.shape[0], num_v_heads // num_k_heads, d_k**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        out.stride(0), out.stride(1), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        D_K=d_k, D_V=d_v, BLOCK_K=block_k, BLOCK_V=block_v,
    )  # fmt: skip
    return out
