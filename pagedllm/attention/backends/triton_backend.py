"""The Triton attention backend: FlashAttention-style kernels over the paged cache.

Cache layout (per layer): key_cache and value_cache are each ``[num_blocks, num_kv_heads,
block_size, head_size]``. Why:

- one KV head of one block is a single contiguous ``block_size * head_size`` run (4 KiB for 16
  tokens of head 128 in bf16), so a ``BLOCK_N``-token tile is ``BLOCK_N / block_size`` long bursts;
  in the torch layout ``[num_blocks, block_size, num_kv_heads, head_size]`` the same tile is
  ``BLOCK_N`` separate 256-byte rows strided by ``num_kv_heads * head_size``;
- K and V share it because the kernels read both the same way, as ``[BLOCK_N, head_size]`` row
  tiles fed to ``tl.dot`` (the CUDA V1 kernel's split K / transposed V layouts suit per-thread
  dot products, not tensor-core tiles);
- ``head_size`` is innermost, so every row is 16-byte vector loads and stores;
- the block number stays dimension 0, as for every backend, so swapping and copying blocks is the
  same indexing.

A step runs three kernels: ``reshape_and_cache`` writes this step's K/V, ``paged_decode`` attends
for the decodes (sequences ``[0, num_decodes)``, FlashDecoding split over the context) and
``paged_prefill`` for the prefill chunks after them (causal over cached prefix + chunk). Grids come
from host ints in the metadata (``max_seq_len``, ``max_query_len``): forward never syncs with the
device, and with ``max_seq_len`` pinned to ``max_model_len`` a decode step is CUDA-graph capturable.

Attention sinks (StreamingLLM, Xiao et al. 2023) are one more stage in each kernel, scoring the sinks
a window has passed with ``sink_query`` (see each kernel's header); a layer without them launches the
kernels compiled before sinks existed (``SINKS`` is a constexpr).
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict

import torch

from pagedllm.attention.backends.abstract import AttentionBackend, KVCache
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.triton import paged_decode, paged_prefill, reshape_and_cache
from pagedllm.kernels.triton.launch import decode_partition_size, default_launches

SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _launch_kwargs(head_size: int, dtype: torch.dtype) -> tuple[dict[str, int], dict[str, int]]:
    """default_launches as keyword dicts, built once per (head_size, dtype) so that forward does
    no more host work than the launches. Read-only: shared by every layer."""
    decode, prefill = default_launches(head_size, dtype)
    return asdict(decode), asdict(prefill)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    fuses_rotary = True

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        shape = (num_blocks, num_kv_heads, block_size, head_size)
        return shape, shape

    @classmethod
    def check_supported(
        cls, head_size: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(f"triton attention: head_size {head_size} not in {SUPPORTED_HEAD_SIZES}")
        if block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"triton attention: block_size {block_size} not in {SUPPORTED_BLOCK_SIZES}")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"triton attention: dtype {dtype} not in {SUPPORTED_DTYPES}")
        # Off CUDA the kernels run only under Triton's interpreter (tests, debugging).
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"triton attention: device {device} needs CUDA (or TRITON_INTERPRET=1)")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        sink_query: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """rotary: ``(cos_sin, index)``, the rotary embedding to apply on the way (``fuses_rotary``):
        the cache write rotates query in place and key into the cache, one kernel for both."""
        sink_query = self._check_sink_query(query, sink_query)
        key_cache, value_cache = kv_cache
        md = attn_metadata
        rotary_inputs = None if rotary is None else (query, *rotary)
        self._write_cache(key, value, key_cache, value_cache, md.slot_mapping, rotary_inputs)
        # Contiguous whatever the query's strides (it is a view of the fused QKV): the kernels
        # write rows of num_heads * head_size.
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        num_decodes = md.num_decodes
        if num_decodes:
            self._decode(
                query[:num_decodes],
                None if sink_query is None else sink_query[:num_decodes],
                key_cache,
                value_cache,
                md.block_tables[:num_decodes],
                md.seq_lens[:num_decodes],
                (md.min_decode_seq_len, md.max_seq_len),
                output[:num_decodes],
            )
        if md.num_prefills:
            self._prefill(
                query,
                sink_query,
                (key_cache, value_cache),
                md.block_tables,
                md.seq_lens,
                md.query_start_loc,
                (num_decodes, md.num_prefills, md.max_query_len),
                output,
            )
        return output

    def _prefill(
        self,
        query: torch.Tensor,
        sink_query: torch.Tensor | None,
        kv_cache: KVCache,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        seqs: tuple[int, int, int],
        out: torch.Tensor,
    ) -> None:
        """paged_prefill for sequences [first, first + count) of the batch, ``seqs = (first,
        count, max_query_len)``. One kernel for every layout: it reads the Triton and vLLM's original
        caches alike. sink_query: the shape of query, None without sinks."""
        key_cache, value_cache = kv_cache
        first_seq, num_seqs, max_query_len = seqs
        paged_prefill(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            self.scale,
            first_seq,
            num_seqs,
            max_query_len,
            out,
            sink_query=sink_query,
            **self._variants(),
            **_launch_kwargs(self.head_size, key_cache.dtype)[1],
        )

    def _write_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, rotary)

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
        """query, out (and sink_query, None without sinks): [num_decodes, num_heads, head_size];
        one new token per sequence. seq_len_range: the (min, max) decode context on the host, min
        0 where unknown."""
        launch = _launch_kwargs(self.head_size, key_cache.dtype)[0]
        min_seq_len, max_seq_len = seq_len_range
        # A windowed layer reads at most a window per sequence: size the partitions for that, so
        # that its few live partitions still fill the GPU (the others exit at once). Its sinks
        # are a few more tiles in the window's first partition, not worth a partition of their own.
        window = self.sliding_window or max_seq_len
        partition_size = decode_partition_size(
            query.shape[0],
            self.num_kv_heads,
            min(max_seq_len, window),
            launch,
            query.device,
            min_seq_len=min(min_seq_len, window),
        )
        paged_decode(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            self.scale,
            max_seq_len,
            out,
            sink_query=sink_query,
            **self._variants(),
            **{**launch, "partition_size": partition_size},
        )

    def _variants(self) -> dict:
        """This layer's attention variants, as the kernels take them."""
        return {
            "sliding_window": self.sliding_window,
            "alibi_slopes": self.alibi_slopes,
            "logits_soft_cap": self.logits_soft_cap,
            "attention_sinks": self.attention_sinks,
        }
