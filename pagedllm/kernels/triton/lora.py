"""Punica's BGMV shrink and expand (Chen et al., 2023, "Punica: Multi-Tenant LoRA Serving"): every
token of a batch multiplied by its own adapter's LoRA weights, all adapters in one launch.

For token t in slot s = slots[t] (s < 0: no adapter, nothing added) and each slice i of a fused
projection (q/k/v: 3, gate/up: 2, else 1)::

    shrink:  h[t, i*R + r]   = sum_k x[t, k] * A[(i*S + s)*R + r, k]              r < R
    expand:  y[t, o]        += sum_r h[t, i(o)*R + r] * B[o, (i(o)*S + s)*R + r]   i(o): o's slice

Layouts (``lora/layers.py``'s slots): x ``[T, in]``, A ``[n*S*R, in]`` (slice-major, then slot, then
rank; a rank-r adapter zero-padded to R), B ``[out, n*S*R]`` (slice i's adapter only in slice i's
output rows), h ``[T, n*R]`` float32, y ``[T, out]``; rows of x, h, y and of A and B have unit
column stride. ``slice_starts``: the first output row of slices 1 and 2 (``out`` past the last).

Grids: shrink ``(T, cdiv(n*R, BLOCK_N))``, each program one token's ``BLOCK_N`` outputs, reading
its adapter's A rows once over ``in`` in ``BLOCK_K`` chunks; expand ``(T, cdiv(out, BLOCK_O))``,
each program ``BLOCK_O`` outputs of one token over the R ranks of their slice. A token without
adapter returns at once.

Bound: memory. A token reads ``n*R*in + out*R`` weight elements (its own adapter's: work does
not grow with the number of slots, unlike the torch path's masked product) and writes
``n*R + out``; FLOPs ``2*(n*R*in + out*R)``. Tokens of one adapter re-read its weights (L2 serves
them within a step); grouping them (SGMV) would matter for long prefills only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(
    h_ptr,
    x_ptr,
    a_ptr,
    slots_ptr,
    in_features,
    num_slots,
    stride_x,
    stride_a,
    stride_h,
    RANK: tl.constexpr,
    NUM_COLS: tl.constexpr,  # n * RANK
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + token)
    col_mask = cols < NUM_COLS
    if slot < 0:
        tl.store(h_ptr + token * stride_h + cols, tl.zeros([BLOCK_N], tl.float32), mask=col_mask)
        return
    # Row of A for output column c = i * R + r: (i * S + slot) * R + r.
    rows = ((cols // RANK) * num_slots + slot) * RANK + cols % RANK
    acc = tl.zeros([BLOCK_N], tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < in_features
        x = tl.load(x_ptr + token * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + rows[:, None].to(tl.int64) * stride_a + k[None, :],
            mask=col_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + token * stride_h + cols, acc, mask=col_mask)


@triton.jit
def _lora_expand_kernel(
    y_ptr,
    h_ptr,
    b_ptr,
    slots_ptr,
    out_features,
    num_slots,
    slice1_start,
    slice2_start,
    stride_y,
    stride_h,
    stride_b,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_mask = offs_o < out_features
    slice_index = (offs_o >= slice1_start).to(tl.int32) + (offs_o >= slice2_start).to(tl.int32)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < RANK
    mask = o_mask[:, None] & r_mask[None, :]
    h = tl.load(
        h_ptr + token * stride_h + slice_index[:, None] * RANK + offs_r[None, :], mask=mask, other=0.0
    )
    b_cols = (slice_index[:, None] * num_slots + slot) * RANK + offs_r[None, :]
    b = tl.load(b_ptr + offs_o[:, None].to(tl.int64) * stride_b + b_cols, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(b * h, axis=1)
    y_ptrs = y_ptr + token * stride_y + offs_o
    y = tl.load(y_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=o_mask)


def lora_shrink_expand(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    num_slots: int,
    rank: int,
    slice_starts: tuple[int, int],
) -> None:
    """y [T, out] += each token's own adapter's (x A^T) B^T, in place (layouts: module docstring).

    token_slots: [T] int32/int64, each token's slot or -1; slice_starts: the first output row of
    slices 1 and 2 (``out`` for a slice that does not exist)."""
    num_tokens, in_features = x.shape
    out_features = y.shape[1]
    num_cols = lora_a.shape[0] // num_slots  # n * R
    assert lora_a.shape == (num_cols * num_slots, in_features) and num_cols % rank == 0
    assert lora_b.shape == (out_features, num_cols * num_slots) and y.shape[0] == num_tokens
    assert token_slots.shape[0] >= num_tokens
    assert x.stride(1) == 1 and y.stride(1) == 1 and lora_a.stride(1) == 1 and lora_b.stride(1) == 1
    if num_tokens == 0:
        return
    h = torch.empty(num_tokens, num_cols, dtype=torch.float32, device=x.device)
    block_n = min(triton.next_power_of_2(num_cols), 64)
    _lora_shrink_kernel[(num_tokens, triton.cdiv(num_cols, block_n))](
        h, x, lora_a, token_slots, in_features, num_slots, x.stride(0), lora_a.stride(0), h.stride(0),
        RANK=rank, NUM_COLS=num_cols, BLOCK_N=block_n, BLOCK_K=128,
    )  # fmt: skip
    block_o = 64
    _lora_expand_kernel[(num_tokens, triton.cdiv(out_features, block_o))](
        y, h, lora_b, token_slots, out_features, num_slots, slice_starts[0], slice_starts[1],
        y.stride(0), h.stride(0), lora_b.stride(0),
        RANK=rank, BLOCK_R=triton.next_power_of_2(rank), BLOCK_O=block_o,
    )  # fmt: skip
