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

A step (``paged.PagedAttentionBackend``) runs three kernels: ``reshape_and_cache`` writes this
step's K/V, rotating query and key on the way (the rotary embedding costs no kernel of its own),
``paged_decode`` attends for the decodes (FlashDecoding split over the context) and
``paged_prefill`` for the prefill chunks after them (causal over cached prefix + chunk).

Attention sinks (StreamingLLM, Xiao et al. 2023) are one more stage in each kernel, scoring the sinks
a window has passed with ``sink_query`` (see each kernel's header); a layer without them launches the
kernels compiled before sinks existed (``SINKS`` is a constexpr).

Context parallelism (``cp_world_size`` P > 1): ``forward_partial`` runs the same three kernels
over this rank's stripe of each context (global position ``t`` at local index ``t // P`` on rank ``t
% P``), each attention kernel reading 1/P of the K/V and writing every query's log-sum-exp beside
its output (see each kernel's header); the decode partitions are sized for the rank's keys.

With ``kv_cache_dtype="fp8"`` the caches are float8_e4m3fn in the same layout (half the bytes per
block): the cache write stores ``saturate(x / scale)`` and both attention kernels widen the tiles
and multiply the layer's scales (``k_scale``, ``v_scale``: device scalars) back in.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict

import torch

from pagedllm.attention.backends.abstract import KVCache
from pagedllm.attention.backends.paged import PagedAttentionBackend, check_kernels_support
from pagedllm.kernels.triton import paged_decode, paged_prefill, reshape_and_cache
from pagedllm.kernels.triton.launch import decode_partition_size, default_launches
from pagedllm.kernels.triton.paged_tiles import compute_dtype
from pagedllm.platform import platform_for

SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _launch_kwargs(head_size: int, dtype: torch.dtype) -> tuple[dict[str, int], dict[str, int]]:
    """default_launches as keyword dicts, built once per (head_size, dtype) so that forward does
    no more host work than the launches. Read-only: shared by every layer."""
    decode, prefill = default_launches(head_size, dtype)
    return asdict(decode), asdict(prefill)


def triton_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The Triton layout (module docstring): K and V each [num_blocks, num_kv_heads, block_size,
    head_size]."""
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    return shape, shape


def write_cache_rotating(
    layer: PagedAttentionBackend,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: KVCache,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None,
) -> torch.Tensor:
    """The cache write in the Triton layout; with a rotary embedding, one kernel rotates query in
    place and key into the cache. Returns the (rotated) query."""
    rows = layer.rotary_rows(positions)
    rotary = None if rows is None else (query, *rows)
    reshape_and_cache(key, value, *kv_cache, slot_mapping, rotary, (layer.k_scale, layer.v_scale))
    return query


def triton_decode(
    layer: PagedAttentionBackend,
    query: torch.Tensor,
    sink_query: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_len_range: tuple[int, int],
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
    query_groups: tuple[torch.Tensor, int] | None = None,
    append: tuple | None = None,
) -> None:
    """paged_decode. query, out (and sink_query, None without sinks): [num_decodes, num_heads,
    head_size]; one new token per sequence. seq_len_range: the (min, max) decode context on the
    host, min 0 where unknown. lse ([num_decodes, num_heads] float32): a partial launch over this
    context-parallel rank's keys (PagedAttentionBackend.forward_partial). query_groups: the
    metadata's (decode_query_lens, max_decode_query_len), paged_decode's query groups. append:
    paged_decode's, the step's K/V written by the decode itself (a step of decodes only)."""
    launch = _launch_kwargs(layer.head_size, compute_dtype(query, key_cache))[0]
    groups = {}
    num_programs = query.shape[0]  # per KV head and partition, those that attend
    if query_groups is not None and query_groups[1] > 1:
        groups = {"query_lens": query_groups[0], "max_query_len": query_groups[1]}
        # Sized as if every request verified the most drafts: a graph's launch is fixed at capture.
        num_programs = -(-num_programs // query_groups[1])
    min_seq_len, max_seq_len = seq_len_range
    # A windowed layer reads at most a window per sequence: size the partitions for that, so
    # that its few live partitions still fill the GPU (the others exit at once). Its sinks
    # are a few more tiles in the window's first partition, not worth a partition of their own.
    # Under context parallelism a rank reads 1 / cp_world_size of each: size for this rank's keys.
    window = layer.sliding_window or max_seq_len
    cp = layer.cp_world_size
    partition_size = decode_partition_size(
        num_programs,
        layer.num_kv_heads,
        -(-min(max_seq_len, window) // cp),
        launch,
        query.device,
        min_seq_len=min(min_seq_len, window) // cp,
    )
    paged_decode(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        layer.scale,
        max_seq_len,
        out,
        sink_query=sink_query,
        k_scale=layer.k_scale,
        v_scale=layer.v_scale,
        cp_rank=layer.cp_rank,
        cp_world_size=cp,
        lse=lse,
        append=append,
        **groups,
        **layer.kernel_variants,
        **{**launch, "partition_size": partition_size},
    )


def triton_prefill(
    layer: PagedAttentionBackend,
    query: torch.Tensor,
    sink_query: torch.Tensor | None,
    kv_cache: KVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seqs: tuple[int, int, int],
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> None:
    """paged_prefill for sequences [first, first + count) of the batch, ``seqs = (first, count,
    max_query_len)``. One kernel for every layout: it reads the Triton and vLLM's original caches
    alike. sink_query: the shape of query, None without sinks. lse ([num_tokens, num_heads]
    float32): a partial launch over this context-parallel rank's keys (forward_partial)."""
    key_cache, value_cache = kv_cache
    first_seq, num_seqs, max_query_len = seqs
    paged_prefill(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        layer.scale,
        first_seq,
        num_seqs,
        max_query_len,
        out,
        sink_query=sink_query,
        k_scale=layer.k_scale,
        v_scale=layer.v_scale,
        cp_rank=layer.cp_rank,
        cp_world_size=layer.cp_world_size,
        lse=lse,
        **layer.kernel_variants,
        **_launch_kwargs(layer.head_size, compute_dtype(query, key_cache))[1],
    )


class TritonAttentionBackend(PagedAttentionBackend):
    """The step with the Triton layout, its rotating cache write and the Triton decode and prefill."""

    name = "triton"
    supports_fp8_kv_cache = True
    groups_decode_queries = True
    appends_in_decode = True
    supports_context_parallel = True
    get_kv_cache_shape = staticmethod(triton_kv_cache_shape)
    write_cache = write_cache_rotating
    decode = triton_decode
    prefill = triton_prefill

    @classmethod
    def check_supported(
        cls, head_size: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        check_kernels_support(
            "triton",
            head_size,
            block_size,
            dtype,
            (SUPPORTED_HEAD_SIZES, SUPPORTED_BLOCK_SIZES, SUPPORTED_DTYPES),
        )
        # Off CUDA the kernels run only under Triton's interpreter (tests, debugging).
        if not platform_for(device).is_cuda() and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"triton attention: device {device} needs CUDA (or TRITON_INTERPRET=1)")
