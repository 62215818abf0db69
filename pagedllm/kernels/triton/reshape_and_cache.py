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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
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
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, NUM_KV_HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_SIZE)

    k = tl.load(
        key_ptr + token * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :] * stride_k_dim,
        mask=mask,
    )
    v = tl.load(
        value_ptr + token * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :] * stride_v_dim,
        mask=mask,
    )
    kc = (
        key_cache_ptr
        + block * stride_kc_block
        + block_offset * stride_kc_slot
        + offs_h[:, None] * stride_kc_head
        + offs_d[None, :] * stride_kc_dim
    )
    vc = (
        value_cache_ptr
        + block * stride_vc_block
        + block_offset * stride_vc_slot
        + offs_h[:, None] * stride_vc_head
        + offs_d[None, :] * stride_vc_dim
    )
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V at its slot; slots < 0 are padding and are skipped.

    key, value: [num_tokens, num_kv_heads, head_size]; key_cache, value_cache: [num_blocks,
    num_kv_heads, block_size, head_size]; slot_mapping: [num_tokens] int32 or int64.
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
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        NUM_KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE=head_size,
        HEAD_DIM=triton.next_power_of_2(head_size),
        BLOCK_SIZE=key_cache.shape[2],
    )
