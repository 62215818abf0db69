"""Rotary position embedding (RoPE, Su et al. 2021), neox style, applied in place to q and k.

Algorithm: the first ``rotary_dim`` dimensions of each head (all of them, or a part: Qwen3-Next
rotates a quarter of each head, Phi-3-style ``partial_rotary_factor``) are rotated among
themselves, the pair ``(x1, x2) = (x[i], x[i + rotary_dim/2])`` by its token's angle ``position *
inv_freq[i]``::

    x1' = x1 * cos - x2 * sin
    x2' = x2 * cos + x1 * sin

with ``cos`` and ``sin`` read from ``cos_sin_cache[position] = [cos | sin]`` (stored in the
activations' dtype, see ``layers/rotary_embedding.py``); the rest of each head is left as it is.
Rounding follows the torch path: each product is rounded to the dtype, then the sum (bit for bit
under the interpreter; compiled for a GPU, a product may be fused into its sum, one rounding
fewer: within an ulp).

Grid: ``(num_tokens,)``. Each program loads its token's position and its ``cos``/``sin`` row once,
then rotates the token's query heads and key heads (one launch for both), ``BLOCK_H`` heads at a
time as ``[BLOCK_H, HALF_DIM]`` tiles of first and second halves of the rotated part
(``HALF_DIM`` is ``rotary_dim / 2`` rounded up to a power of two, the padding masked).

Layouts: query ``[num_tokens, num_heads * head_size]`` and key ``[num_tokens, num_kv_heads *
head_size]``, any row stride (views of the fused QKV output), the heads contiguous within a row;
positions ``[num_tokens]`` int32/int64, any stride, each in ``[0, max_position)`` (not checked on
the device: that would sync); cos_sin_cache ``[max_position, rotary_dim]``.

Bound: memory. Bytes ``2 * num_tokens * (num_heads + num_kv_heads) * rotary_dim * element_size``
(the rotated part of q and k read and written once; a partial rotation moves nothing else, where
the torch path copies whole heads to join the parts) + one cos/sin row per token; 6 FLOPs per pair.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rotate_heads(
    x_ptr,  # this token's row: NUM_HEADS heads of HEAD_SIZE, contiguous
    cos,
    sin,  # [HALF_DIM] float32, this token's angles (padding zero)
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    ROTARY_DIM: tl.constexpr,  # the rotated dimensions at the start of each head
    HALF_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    dtype = x_ptr.dtype.element_ty
    offs_d = tl.arange(0, HALF_DIM)
    for head_start in range(0, NUM_HEADS, BLOCK_H):
        offs_h = head_start + tl.arange(0, BLOCK_H)
        mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < ROTARY_DIM // 2)
        first_ptrs = x_ptr + offs_h[:, None] * HEAD_SIZE + offs_d[None, :]
        second_ptrs = first_ptrs + ROTARY_DIM // 2
        x1 = tl.load(first_ptrs, mask=mask, other=0.0)
        x2 = tl.load(second_ptrs, mask=mask, other=0.0)
        out1, out2 = rotate_pair(x1, x2, cos, sin, dtype)
        tl.store(first_ptrs, out1, mask=mask)
        tl.store(second_ptrs, out2, mask=mask)


@triton.jit
def rotate_pair(x1, x2, cos, sin, dtype: tl.constexpr):
    """The halves ``[rows, HALF_DIM]`` of heads rotated by ``cos``/``sin`` ``[HALF_DIM]`` float32,
    returned in ``dtype``. Each product is rounded to the dtype before the sum, as the torch path's
    separate ops do."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    x1_cos = (x1 * cos[None, :]).to(dtype).to(tl.float32)
    x2_sin = (x2 * sin[None, :]).to(dtype).to(tl.float32)
    x2_cos = (x2 * cos[None, :]).to(dtype).to(tl.float32)
    x1_sin = (x1 * sin[None, :]).to(dtype).to(tl.float32)
    return (x1_cos - x2_sin).to(dtype), (x2_cos + x1_sin).to(dtype)


@triton.jit
def _rotary_kernel(
    query_ptr,
    key_ptr,
    positions_ptr,
    cos_sin_cache_ptr,
    stride_q_tok,
    stride_k_tok,
    stride_pos,
    stride_cache_pos,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    HALF_DIM: tl.constexpr,
    BLOCK_H_Q: tl.constexpr,
    BLOCK_H_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token * stride_pos).to(tl.int64)
    offs_d = tl.arange(0, HALF_DIM)
    d_mask = offs_d < ROTARY_DIM // 2
    cache_row = cos_sin_cache_ptr + position * stride_cache_pos
    cos = tl.load(cache_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_row + ROTARY_DIM // 2 + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    query_row = query_ptr + token * stride_q_tok
    rotate_heads(query_row, cos, sin, NUM_HEADS, HEAD_SIZE, ROTARY_DIM, HALF_DIM, BLOCK_H_Q)
    key_row = key_ptr + token * stride_k_tok
    rotate_heads(key_row, cos, sin, NUM_KV_HEADS, HEAD_SIZE, ROTARY_DIM, HALF_DIM, BLOCK_H_K)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    rotary_dim: int | None = None,
) -> None:
    """Rotate query and key in place by their tokens' positions (neox style): the first
    ``rotary_dim`` dimensions of each head (all of them when None), the rest left as they are.

    positions: [num_tokens] int32/int64; query: [num_tokens, num_heads * head_size]; key:
    [num_tokens, num_kv_heads * head_size]; cos_sin_cache: [max_position, rotary_dim] holding
    ``[cos | sin]``, in the dtype of query and key.
    """
    rotary_dim = head_size if rotary_dim is None else rotary_dim
    num_tokens = positions.shape[0]
    assert positions.dim() == 1 and positions.dtype in (torch.int32, torch.int64), (
        f"positions {tuple(positions.shape)} {positions.dtype}"
    )
    assert query.dim() == key.dim() == 2 and query.shape[0] == key.shape[0] == num_tokens, (
        f"query {tuple(query.shape)}, key {tuple(key.shape)}, {num_tokens} positions"
    )
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= head_size, f"rotary_dim {rotary_dim} of {head_size}"
    assert query.shape[1] % head_size == 0 and key.shape[1] % head_size == 0
    # Same dtype everywhere: the products are rounded to it, as the torch path rounds them.
    assert query.dtype == key.dtype == cos_sin_cache.dtype, (
        f"query {query.dtype}, key {key.dtype}, cos_sin_cache {cos_sin_cache.dtype}"
    )
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == rotary_dim
    # Heads are addressed as offsets within a row.
    assert query.stride(1) == key.stride(1) == cos_sin_cache.stride(1) == 1, "rows must be contiguous"
    if num_tokens == 0:
        return
    num_heads, num_kv_heads = query.shape[1] // head_size, key.shape[1] // head_size
    half_dim = triton.next_power_of_2(rotary_dim // 2)
    _rotary_kernel[(num_tokens,)](
        query, key, positions, cos_sin_cache,
        query.stride(0), key.stride(0), positions.stride(0), cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, ROTARY_DIM=rotary_dim,
        HALF_DIM=half_dim,
        BLOCK_H_Q=heads_per_tile(num_heads, half_dim), BLOCK_H_K=heads_per_tile(num_kv_heads, half_dim),
    )  # fmt: skip


def heads_per_tile(num_heads: int, half_dim: int) -> int:
    """Heads per ``[BLOCK_H, HALF_DIM]`` tile: up to 2048 elements per half, 16 per thread at the
    default 4 warps, enough loads in flight without spilling the four float32 products."""
    return min(triton.next_power_of_2(num_heads), max(1, 2048 // half_dim))
