"""A decode-only step's cache write and rotary embedding, done by the decode kernel itself.

A one-token decode step writes each sequence's new key and value into the paged cache, rotating
the query and key first (``reshape_and_cache.py``), then attends (``paged_decode.py``): two kernels
per layer, for a few KiB of work. At batch one the launch boundary, not the bytes, is the cost:
on an H200, W3 (Llama-3.1-8B, one sequence) ran 0.23 ms a token faster with the cache-write
kernel left out (4.42 against 4.65 ms, one call). With ``APPEND`` the decode kernel does both
(as FlashAttention's ``flash_attn_with_kvcache`` appends and rotates before it attends):

* every program rotates its rows of the query in registers (the query stays unrotated in memory:
  nothing else reads it in a decode-only step);
* the program whose partition holds the sequence's last key (the new token's, at ``seq_len - 1``)
  rotates the new key of its KV head and stores it, and the new value, at the token's slot (none
  for a padding row's slot -1), then meets its threads at a CTA barrier, so its own tile loads
  read them. No other program reads that slot.

The rounding is ``rotary.rotate_pair``'s: each product rounded to the dtype before the sum, so
the cache holds the bits the separate kernels would write and the scores are theirs. The halves
are not split: a full-width row is rotated against its partner row (element ``d`` with ``d +
half``, mod the head size), read by a second load, with the sign of the sine term per element.
FP8 caches store ``saturate(x / scale)`` as ``reshape_and_cache.to_cache`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.reshape_and_cache import to_cache


@triton.jit
def rope_angles(cos_sin_ptr, cos_sin_index_ptr, seq, stride_cos_sin, offs_d, HEAD_SIZE: tl.constexpr):
    """For full-width rows ``[HEAD_DIM]``: each element's cos and sin (float32), its partner's
    index and the sine term's sign (-1 in the first half, +1 in the second)."""
    half: tl.constexpr = HEAD_SIZE // 2
    d_mask = offs_d < HEAD_SIZE
    angle = offs_d % half
    row = cos_sin_ptr + tl.load(cos_sin_index_ptr + seq).to(tl.int64) * stride_cos_sin
    cos = tl.load(row + angle, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(row + half + angle, mask=d_mask, other=0.0).to(tl.float32)
    partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
    sign = tl.where(offs_d < half, -1.0, 1.0)
    return cos, sin, partner, sign


@triton.jit
def rotate_rows(x, partner, cos, sin, sign, dtype: tl.constexpr):
    """``x`` (``partner``: the same elements at the partner indices) rotated, in ``dtype``,
    rounded as ``rotary.rotate_pair``; cos, sin and sign broadcast to x's shape by the caller."""
    x_cos = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
    partner_sin = (partner.to(tl.float32) * sin).to(dtype).to(tl.float32)
    return (x_cos + sign * partner_sin).to(dtype)


@triton.jit
def append_token(
    key_new,  # (this sequence's new key for this KV head, its dimension stride)
    value_new,
    slot,
    keys,  # the key cache at this KV head: (base, block stride, slot stride, dimension offsets)
    values,
    scales,  # (k_scale_ptr, v_scale_ptr), read when KV_FP8
    offs_d,
    rope,  # rope_angles' tuple, read when ROTARY
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROTARY: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Store the new token's key (rotated) and value at ``slot``; nothing for a negative slot."""
    if slot >= 0:
        d_mask = offs_d < HEAD_SIZE
        key_row, stride_kn_dim = key_new
        value_row, stride_vn_dim = value_new
        key = tl.load(key_row + offs_d * stride_kn_dim, mask=d_mask, other=0.0)
        if ROTARY:
            cos, sin, partner, sign = rope
            partner_key = tl.load(key_row + partner * stride_kn_dim, mask=d_mask, other=0.0)
            key = rotate_rows(key, partner_key, cos, sin, sign, key_row.dtype.element_ty)
        value = tl.load(value_row + offs_d * stride_vn_dim, mask=d_mask, other=0.0)
        k_scale = 1.0
        v_scale = 1.0
        if KV_FP8:
            k_scale = tl.load(scales[0])
            v_scale = tl.load(scales[1])
        _store_at_slot(keys, key, k_scale, slot, d_mask, BLOCK_SIZE, KV_FP8)
        _store_at_slot(values, value, v_scale, slot, d_mask, BLOCK_SIZE, KV_FP8)


@triton.jit
def _store_at_slot(cache, x, scale, slot, mask, BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr):
    """One row of a cache at a token's slot: ``cache`` is (base at the KV head, block stride, slot
    stride, dimension offsets)."""
    base, stride_block, stride_slot, dim_offs = cache
    row = base + slot // BLOCK_SIZE * stride_block + slot % BLOCK_SIZE * stride_slot
    tl.store(row + dim_offs, to_cache(x, base, scale, KV_FP8), mask=mask)


@triton.jit
def rotate_and_append(
    q,  # [BLOCK_H, HEAD_DIM] this program's query rows, as loaded
    q_at,  # (their row pointers, the dimension stride, their mask)
    seq,
    holds_new_key,  # this program's partition holds the sequence's last key
    key_new,
    value_new,
    slot_mapping_ptr,
    rotary,  # (cos_sin_ptr, cos_sin_index_ptr, stride_cos_sin), read when ROTARY
    caches,  # (keys, values, scales) as append_token takes them
    offs_d,
    CONFIG: tl.constexpr,  # (HEAD_SIZE, BLOCK_SIZE, ROTARY, KV_FP8)
):
    """The query rows rotated (when ROTARY); the new token's K/V stored first by the program
    that holds its key, which then meets its threads at a CTA barrier before it reads any tile."""
    HEAD_SIZE: tl.constexpr = CONFIG[0]
    ROTARY: tl.constexpr = CONFIG[2]
    rope = (0.0, 0.0, offs_d, 0.0)
    if ROTARY:
        rope = rope_angles(rotary[0], rotary[1], seq, rotary[2], offs_d, HEAD_SIZE)
        cos, sin, partner, sign = rope
        q_rows, stride_q_dim, row_mask = q_at
        q_partner = tl.load(q_rows + partner[None, :] * stride_q_dim, mask=row_mask, other=0.0)
        q = rotate_rows(q, q_partner, cos[None, :], sin[None, :], sign[None, :], q.dtype)
    if holds_new_key:
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
        keys, values, scales = caches
        append_token(key_new, value_new, slot, keys, values, scales, offs_d, rope, *CONFIG)
        tl.debug_barrier()
    return q


def append_args(
    append: tuple | None, query: torch.Tensor, num_kv_heads: int, one_query_per_sequence: bool
) -> tuple[list, list, dict]:
    """``paged_decode``'s ``append`` as the kernel's arguments: (pointers, strides, constexprs).
    ``append``: (key, value, slot_mapping, rotary) with key/value [num_seqs, num_kv_heads,
    head_size], slot_mapping [num_seqs], rotary None or (cos_sin [rows, head_size], index
    [num_seqs]); None: no append (pointers never read). ``one_query_per_sequence``: the launch has
    no query groups, StreamingLLM sinks or context parallelism, which the append cannot serve."""
    if append is None:
        return [query] * 5, [0] * 7, {"APPEND": False, "ROTARY": False}
    assert one_query_per_sequence, "append: one query per sequence, no sinks, no context parallelism"
    key, value, slot_mapping, rotary = append
    num_seqs, _, head_size = query.shape
    assert key.shape == value.shape == (num_seqs, num_kv_heads, head_size), "append: the cache's KV heads"
    assert slot_mapping.shape == (num_seqs,), f"slot_mapping {tuple(slot_mapping.shape)}"
    cos_sin, index = rotary if rotary is not None else (query, slot_mapping)
    if rotary is not None:
        assert cos_sin.shape[1] == head_size and cos_sin.dtype == key.dtype == query.dtype
        assert index.shape == (num_seqs,) and head_size % 2 == 0
    pointers = [key, value, slot_mapping, cos_sin, index]
    strides = [*key.stride(), *value.stride(), cos_sin.stride(0)]
    return pointers, strides, {"APPEND": True, "ROTARY": rotary is not None}
