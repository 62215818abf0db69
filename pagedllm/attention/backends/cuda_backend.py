"""The CUDA attention backend: vLLM's original PagedAttention kernels in CUDA C++, over their cache layout.

Cache layout (per layer), as vLLM's ``reshape_and_cache`` writes it and its kernels read it::

    key_cache   [num_blocks, num_kv_heads, head_size / x, block_size, x]     x = 16 bytes / element size
    value_cache [num_blocks, num_kv_heads, head_size, block_size]

(why K and V differ: ``pagedllm.kernels.cuda.layout``); the block number stays dimension 0 of both,
so the cache engine swaps and copies blocks as for every backend.

A step (``paged.PagedAttentionBackend``) runs three kernels: vLLM's ``reshape_and_cache`` (CUDA)
writes this step's K/V, after the rotary embedding has turned query and key (its kernel does not
rotate); PagedAttention V1 or V2 (CUDA, chosen per step by ``ops.use_v1`` from host ints) attends
for the decodes, sequences ``[0, num_decodes)``; the prefill chunks after them run the Triton
``paged_prefill`` piece, which reads this layout as well as its own (``paged_tiles.PagedKVLayout``).
vLLM's original kernels are decode-only: their prompt path ran xformers over the step's un-paged
K/V, which cannot see a cached prefix, so chunked prefill and prefix caching need a kernel that
attends over the paged cache, and one FlashAttention-style kernel serves both backends. Like the
Triton backend, forward never syncs with the device.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backends.abstract import KVCache
from pagedllm.attention.backends.paged import PagedAttentionBackend, check_kernels_support
from pagedllm.attention.backends.triton_backend import triton_prefill
from pagedllm.kernels.cuda import paged_attention, reshape_and_cache
from pagedllm.kernels.cuda.build import check_build_requirements
from pagedllm.kernels.cuda.layout import kv_cache_shape
from pagedllm.kernels.cuda.ops import SUPPORTED_BLOCK_SIZES, SUPPORTED_DTYPES, SUPPORTED_HEAD_SIZES
from pagedllm.platform import platform_for


def write_cache_after_rotary(
    layer: PagedAttentionBackend,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: KVCache,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None,
) -> torch.Tensor:
    """vLLM's cache write, which does not rotate: the layer's rotary embedding turns query and
    key first. Returns the (rotated) query."""
    query, key = layer.rotate(positions, query, key)
    reshape_and_cache(key, value, *kv_cache, slot_mapping)
    return query


def cuda_decode(
    layer: PagedAttentionBackend,
    query: torch.Tensor,
    sink_query: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_len_range: tuple[int, int],
    out: torch.Tensor,
) -> None:
    """PagedAttention V1 or V2 (from host ints, ``ops.use_v1``); shapes as ``triton_decode``'s."""
    variants = layer.sliding_window, layer.logits_soft_cap, layer.sinks
    if any(v is not None for v in variants) or layer.attention_sinks:
        # vLLM's original kernels know ALiBi only: a windowed, soft-capped or sink-keeping layer
        # decodes with the layer's prefill (one query per sequence), which reads this layout,
        # starts at the window's first tile and scores the sinks with sink_query.
        # Graph-capturable as the Triton decode is: the grid comes from host ints only.
        num_decodes = query.shape[0]
        query_start_loc = torch.arange(num_decodes + 1, dtype=torch.int32, device=query.device)
        layer.prefill(
            query,
            sink_query,
            (key_cache, value_cache),
            block_tables,
            seq_lens,
            query_start_loc,
            (0, num_decodes, 1),
            out,
        )
        return
    paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        layer.scale,
        seq_len_range[1],
        out,
        layer.alibi_slopes,
    )


class CudaAttentionBackend(PagedAttentionBackend):
    """The step with vLLM's original layout, cache write and decode kernels, and the Triton
    prefill. Decode reads only host ints, so it is captured in CUDA graphs too."""

    name = "cuda"
    get_kv_cache_shape = staticmethod(kv_cache_shape)
    write_cache = write_cache_after_rotary
    decode = cuda_decode
    prefill = triton_prefill

    @classmethod
    def check_supported(
        cls, head_size: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """ValueError for what the kernels are not built for; RuntimeError (from the build's
        checks) for a missing CUDA torch, GPU, nvcc or ninja, before any weights are loaded."""
        check_kernels_support(
            "cuda",
            head_size,
            block_size,
            dtype,
            (SUPPORTED_HEAD_SIZES, SUPPORTED_BLOCK_SIZES, SUPPORTED_DTYPES),
        )
        if not platform_for(device).is_cuda():
            raise ValueError(f"cuda attention: device {device} is not a CUDA device")
        check_build_requirements()
