"""The CUDA attention backend: vLLM's original PagedAttention kernels in CUDA C++, over their cache layout.

Cache layout (per layer), as vLLM's ``reshape_and_cache`` writes it and its kernels read it::

    key_cache   [num_blocks, num_kv_heads, head_size / x, block_size, x]     x = 16 bytes / element size
    value_cache [num_blocks, num_kv_heads, head_size, block_size]

(why K and V differ: ``pagedllm.kernels.cuda.layout``); the block number stays dimension 0 of both,
so the cache engine swaps and copies blocks as for every backend.

A step runs three kernels: ``reshape_and_cache`` (CUDA) writes this step's K/V; PagedAttention V1 or
V2 (CUDA, chosen per step by ``ops.use_v1`` from host ints) attends for the decodes, sequences
``[0, num_decodes)``; the prefill chunks after them run the Triton ``paged_prefill``, which reads
this layout as well as its own (``paged_tiles.PagedKVLayout``). vLLM's original kernels are decode-only:
their prompt path ran xformers over the step's un-paged K/V, which cannot see a cached prefix, so
chunked prefill and prefix caching need a kernel that attends over the paged cache, and one
FlashAttention-style kernel serves both backends. Like the Triton backend, forward never syncs
with the device.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backends.triton_backend import TritonAttentionBackend
from pagedllm.kernels.cuda import paged_attention, reshape_and_cache
from pagedllm.kernels.cuda.build import check_build_requirements
from pagedllm.kernels.cuda.layout import kv_cache_shape
from pagedllm.kernels.cuda.ops import SUPPORTED_BLOCK_SIZES, SUPPORTED_DTYPES, SUPPORTED_HEAD_SIZES


class CudaAttentionBackend(TritonAttentionBackend):
    """The Triton backend's step (and its prefill kernel) with vLLM's original layout, cache write and
    decode kernels. Decode reads only host ints, so it is captured in CUDA graphs too."""

    name = "cuda"
    # vLLM's original cache layout is written by its own kernel, which does not rotate.
    fuses_rotary = False

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, dtype)

    @classmethod
    def check_supported(
        cls, head_size: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """ValueError for what the kernels are not built for; RuntimeError (from the build's
        checks) for a missing CUDA torch, GPU, nvcc or ninja, before any weights are loaded."""
        if head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(f"cuda attention: head_size {head_size} not in {SUPPORTED_HEAD_SIZES}")
        if block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"cuda attention: block_size {block_size} not in {SUPPORTED_BLOCK_SIZES}")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"cuda attention: dtype {dtype} not in {SUPPORTED_DTYPES}")
        if device.type != "cuda":
            raise ValueError(f"cuda attention: device {device} is not a CUDA device")
        check_build_requirements()

    def _write_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        assert rotary is None, "the cuda backend does not fuse the rotary embedding"
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def _decode(
        self,
        query: torch.Tensor,
        sink_query: torch.Tensor | None,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_len_range: tuple[int, int],
        out: torch.Tensor,
    ) -> None:
        if self.sliding_window is not None or self.logits_soft_cap is not None or self.attention_sinks:
            # vLLM's original kernels know ALiBi only: a windowed, soft-capped or sink-keeping layer
            # decodes with the Triton prefill kernel (one query per sequence), which reads this
            # layout, starts at the window's first tile and scores the sinks with sink_query.
            # Graph-capturable as the Triton decode is: the grid comes from host ints only.
            num_decodes = query.shape[0]
            query_start_loc = torch.arange(num_decodes + 1, dtype=torch.int32, device=query.device)
            self._prefill(
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
        # V1 or V2, from host ints (ops.use_v1).
        paged_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            self.scale,
            seq_len_range[1],
            out,
            self.alibi_slopes,
        )
