"""Write this step's K/V into the paged cache at each token's slot (vLLM's ``reshape_and_cache``).

Algorithm: token ``t`` goes to slot ``slot_mapping[t]``, i.e. block ``slot // block_size``,
position ``slot % block_size``; a negative slot marks a padding token (CUDA-graph batches are padded
to a captured size) and is skipped.

Grid: ``(num_tokens,)``. Each program copies one token's K and V for all KV heads at once, as a
``[NUM_KV_HEADS_PAD, HEAD_DIM]`` tile per tensor (rows padded to a power of two, columns to
``HEAD_DIM`` >= ``head_size``, both masked), so a token's ``num_kv_heads * head_size`` elements go
out in one wide, coalesced store.

Layouts: reads key/value ``[num_tokens, num_kv_heads, head_size]`` (any strides; often a view of
the fused QKV projection); writes key_cache/value_cache ``[num_blocks, num_kv_heads, block_size,
head_size]`` with ``head_size`` contiguous.

Bound: pure copy, ``4 * num_tokens * num_kv_heads * head_size * element_size`` bytes (read + write,
K and V); nothing to compute. For a decode batch this is ~1/seq_len of the attention's traffic.

With ``rotary`` the same program also applies the rotary embedding (neox style, ``rotary.py``'s
rounding): it rotates the token's query heads in place and its key heads on the way to the cache,
from the token's ``[cos | sin]`` row. One launch and one read of K instead of the rotary kernel's
read and write of q and k followed by this copy: at a decode step of one sequence the launches are
most of the cost (W3's profile on an H200: 117 us per token for the two kernels over 32 layers).
A token whose slot is negative stores nothing, but its query is still rotated: with context
parallelism (``attention/context_parallel.py``) another rank stores it and this one attends with
its query (a padding token's rotated query is simply unused).

With float8_e4m3fn caches (``kv_cache_dtype="fp8"``) each element is stored as ``saturate(x /
scale)`` with its tensor's per-layer scale (two float32 loads per program): half the bytes
written, and the attention kernels multiply the scale back in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel
from pagedllm.kernels.triton.rotary import heads_per_tile, rotate_heads, rotate_pair

# The largest finite float8_e4m3fn (the FP8 cache saturates there, as vLLM's scaled conversion does).
FP8_E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    query_ptr,  # read when ROTARY: [num_tokens, NUM_HEADS * HEAD_SIZE] rows, rotated in place
    cos_sin_ptr,  # read when ROTARY: [rows, HEAD_SIZE] = [cos | sin]
    cos_sin_index_ptr,  # read when ROTARY: [num_tokens], each token's row of cos_sin
    k_scale_ptr,  # [] float32, read when KV_FP8
    v_scale_ptr,  # [] float32, read when KV_FP8
    stride_q_tok,
    stride_cos_sin,
    stride_k_tok,
    stride_k_head,
    stride_k_dim,
    stride_v_tok,
    stride_v_head,
    stride_v_dim,
    stride_kc_block,
    stride_kc_head,
    stride_kc_slot,
    stride_kc_dim,
    stride_vc_block,
    stride_vc_head,
    stride_vc_slot,
    stride_vc_dim,
    NUM_KV_HEADS: tl.constexpr,
    NUM_KV_HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROTARY: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HALF_DIM: tl.constexpr,
    BLOCK_H_Q: tl.constexpr,
    KV_FP8: tl.constexpr,  # the caches hold float8_e4m3fn: store saturate(x / scale)
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs_half = tl.arange(0, HALF_DIM)
    half_mask = offs_half < HEAD_SIZE // 2
    if ROTARY:
        cos_sin_row = cos_sin_ptr + tl.load(cos_sin_index_ptr + token).to(tl.int64) * stride_cos_sin
        cos = tl.load(cos_sin_row + offs_half, mask=half_mask, other=0.0).to(tl.float32)
        sin = tl.load(cos_sin_row + HEAD_SIZE // 2 + offs_half, mask=half_mask, other=0.0).to(tl.float32)
        query_row = query_ptr + token * stride_q_tok
        rotate_heads(query_row, cos, sin, NUM_HEADS, HEAD_SIZE, HEAD_SIZE, HALF_DIM, BLOCK_H_Q)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, NUM_KV_HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_SIZE)
    k_row = key_ptr + token * stride_k_tok + offs_h[:, None] * stride_k_head
    kc_row = (
        key_cache_ptr
        + block * stride_kc_block
        + block_offset * stride_kc_slot
        + offs_h[:, None] * stride_kc_head
    )
    k_scale = 1.0
    v_scale = 1.0
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    if ROTARY:
        k_mask = (offs_h[:, None] < NUM_KV_HEADS) & half_mask[None, :]
        k1 = tl.load(k_row + offs_half[None, :] * stride_k_dim, mask=k_mask, other=0.0)
        k2 = tl.load(k_row + (HEAD_SIZE // 2 + offs_half[None, :]) * stride_k_dim, mask=k_mask, other=0.0)
        k1, k2 = rotate_pair(k1, k2, cos, sin, key_ptr.dtype.element_ty)
        k1 = to_cache(k1, key_cache_ptr, k_scale, KV_FP8)
        k2 = to_cache(k2, key_cache_ptr, k_scale, KV_FP8)
        tl.store(kc_row + offs_half[None, :] * stride_kc_dim, k1, mask=k_mask)
        tl.store(kc_row + (HEAD_SIZE // 2 + offs_half[None, :]) * stride_kc_dim, k2, mask=k_mask)
    else:
        k = tl.load(k_row + offs_d[None, :] * stride_k_dim, mask=mask)
        k = to_cache(k, key_cache_ptr, k_scale, KV_FP8)
        tl.store(kc_row + offs_d[None, :] * stride_kc_dim, k, mask=mask)
    v = tl.load(
        value_ptr + token * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :] * stride_v_dim,
        mask=mask,
    )
    vc = (
        value_cache_ptr
        + block * stride_vc_block
        + block_offset * stride_vc_slot
        + offs_h[:, None] * stride_vc_head
        + offs_d[None, :] * stride_vc_dim
    )
    tl.store(vc, to_cache(v, value_cache_ptr, v_scale, KV_FP8), mask=mask)


@triton.jit
def to_cache(x, cache_ptr, scale, KV_FP8: tl.constexpr):
    """x as ``cache_ptr``'s cache stores it: cast, or for an FP8 cache ``x / scale`` in float32,
    saturated to e4m3's finite range (a plain cast overflows to NaN) and rounded to nearest."""
    if KV_FP8:
        # Correctly rounded (PTX div.rn; Triton's "/" is the approximate div.full): the stored
        # bytes are then torch's, (x / scale).to(float8_e4m3fn), bit for bit.
        x = tl.math.div_rn(x.to(tl.float32), scale)
        x = tl.minimum(tl.maximum(x, -FP8_E4M3_MAX), FP8_E4M3_MAX)
    return x.to(cache_ptr.dtype.element_ty)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store each token's K/V at its slot; slots < 0 are padding and are skipped.

    key, value: [num_tokens, num_kv_heads, head_size]; key_cache, value_cache: [num_blocks,
    num_kv_heads, block_size, head_size]; slot_mapping: [num_tokens] int32 or int64.

    rotary: ``(query, cos_sin, index)`` to rotate query (in place) and key (into the cache) first:
    query [num_tokens, num_heads, head_size] with each token's heads contiguous; cos_sin [rows,
    head_size] = ``[cos | sin]`` in key's dtype; index [num_tokens], each token's row of it.

    kv_scales: ``(k_scale, v_scale)``, float32 scalars on the device, required by float8_e4m3fn
    caches (kv_cache_dtype="fp8"), which store ``saturate(x / scale)``; unread otherwise.
    """
    num_tokens, num_kv_heads, head_size = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert key_cache.shape == value_cache.shape and key_cache.dim() == 4
    assert key_cache.shape[1] == num_kv_heads and key_cache.shape[3] == head_size, (
        f"cache {tuple(key_cache.shape)} does not hold {num_kv_heads} heads of size {head_size}"
    )
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)}"
    assert slot_mapping.dtype in (torch.int32, torch.int64), f"slot_mapping dtype {slot_mapping.dtype}"
    if num_tokens == 0:
        return
    query, cos_sin, index = rotary if rotary is not None else (key, key, slot_mapping)
    num_heads = query.shape[1]
    if rotary is not None:
        assert query.shape == (num_tokens, num_heads, head_size) and query.stride(2) == 1, (
            f"query {tuple(query.shape)} strides {query.stride()}"
        )
        assert query.stride(1) == head_size, "a token's query heads must be contiguous"
        assert cos_sin.shape[1] == head_size and cos_sin.dtype == key.dtype == query.dtype
        assert index.shape == (num_tokens,), f"index {tuple(index.shape)}"
    kv_fp8 = key_cache.dtype == torch.float8_e4m3fn
    if kv_fp8:
        assert kv_scales is not None, "an FP8 cache needs kv_scales"
        assert all(s.dtype == torch.float32 and s.numel() == 1 for s in kv_scales), "float32 scalar scales"
    half_dim = triton.next_power_of_2(head_size // 2)
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        query,
        cos_sin,
        index,
        *(kv_scales if kv_fp8 else (key, key)),  # pointers never read without FP8
        query.stride(0),
        cos_sin.stride(0),
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        NUM_KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE=head_size,
        HEAD_DIM=triton.next_power_of_2(head_size),
        BLOCK_SIZE=key_cache.shape[2],
        ROTARY=rotary is not None,
        NUM_HEADS=num_heads,
        HALF_DIM=half_dim,
        BLOCK_H_Q=heads_per_tile(num_heads, half_dim),
        KV_FP8=kv_fp8,
        **pdl_options(key.device),
    )
