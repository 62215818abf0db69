"""vLLM's original paged KV cache layout in PyTorch: its shapes, a reference cache write, conversions.

Per layer (vLLM's ``reshape_and_cache``, vLLM's tensor shapes)::

    key_cache   [num_blocks, num_kv_heads, head_size / x, block_size, x]     x = 16 bytes / element size
    value_cache [num_blocks, num_kv_heads, head_size, block_size]

Why they differ (vLLM's original kernel): in the QK pass the thread groups of a warp each take one token of a
block and read the same ``x``-element (16-byte) piece of their tokens' keys, so putting
``block_size`` below ``head_size / x`` makes that read one contiguous run, and each group's dot
product lands in a different logit. In the PV pass a lane reads 16 bytes of one head dimension for
consecutive tokens, so V keeps ``block_size`` innermost. The block number stays dimension 0 of both,
so the cache engine swaps and copies blocks with the same indexing as for every other backend.

Nothing here needs a GPU or the compiled kernels: the tests use it on the CPU to build caches for the
Triton prefill kernel, and as the oracle of the CUDA ``reshape_and_cache``.
"""

from __future__ import annotations

import torch


def cache_x(dtype: torch.dtype) -> int:
    """Elements in 16 bytes: 8 for float16/bfloat16, 4 for float32."""
    return 16 // torch.tensor([], dtype=dtype).element_size()


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(key_cache shape, value_cache shape) of one layer."""
    x = cache_x(dtype)
    if head_size % x:
        raise ValueError(f"head_size {head_size} is not a multiple of x = {x} for {dtype}")
    key_shape = (num_blocks, num_kv_heads, head_size // x, block_size, x)
    value_shape = (num_blocks, num_kv_heads, head_size, block_size)
    return key_shape, value_shape


def reshape_and_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """What the CUDA ``reshape_and_cache`` does, in PyTorch: token ``t`` goes to block
    ``slot // block_size``, offset ``slot % block_size``; element ``d`` of its key to piece
    ``d // x``, position ``d % x``; element ``d`` of its value to row ``d``. Slots < 0 are padding.

    key, value: [num_tokens, num_kv_heads, head_size]; caches in vLLM's original layout;
    slot_mapping: [num_tokens].
    """
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    num_kv_heads, num_chunks, block_size, x = key_cache.shape[1:]
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced indices on dims 0 and 3 (split by slices) index [num_valid, num_kv_heads, ...].
    keys = key[valid].reshape(-1, num_kv_heads, num_chunks, x)
    key_cache[blocks, :, :, offsets, :] = keys.to(key_cache.dtype)
    value_cache[blocks, :, :, offsets] = value[valid].to(value_cache.dtype)


def from_triton_layout(
    key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of caches in the Triton backend's layout (both ``[num_blocks, num_kv_heads,
    block_size, head_size]``) in vLLM's original layout: the same blocks, the same block tables."""
    num_blocks, num_kv_heads, block_size, head_size = key_cache.shape
    x = cache_x(key_cache.dtype)
    key = key_cache.view(num_blocks, num_kv_heads, block_size, head_size // x, x).permute(0, 1, 3, 2, 4)
    return key.contiguous(), value_cache.transpose(2, 3).contiguous()


def to_triton_layout(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``from_triton_layout``: vLLM-layout caches as ``[num_blocks,
    num_kv_heads, block_size, head_size]`` copies (for the torch oracle, permute those)."""
    num_blocks, num_kv_heads, num_chunks, block_size, x = key_cache.shape
    key = key_cache.permute(0, 1, 3, 2, 4).reshape(num_blocks, num_kv_heads, block_size, num_chunks * x)
    return key.contiguous(), value_cache.transpose(2, 3).contiguous()
