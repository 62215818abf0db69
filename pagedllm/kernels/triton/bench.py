"""Decode attention bandwidth: the paged Triton kernel against SDPA and a plain copy (CUDA only).

Decode reads every cached K/V element once and does ~2 * num_queries_per_kv FLOPs per byte, so its
figure of merit is achieved bandwidth: bytes of K/V (plus the small query/output) over the median
kernel time from ``triton.testing.do_bench``. The ceiling is a device-to-device copy of the same
bytes (read + write), measured the same way; SDPA runs on the same K/V in a contiguous
``[batch, num_kv_heads, context_len, head_size]`` layout, with each GQA group as its queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing

from pagedllm.kernels.triton.paged_decode import paged_decode


@dataclass(frozen=True)
class DecodeBench:
    """Median times (ms) and achieved bandwidths (GB/s) of one decode shape."""

    bytes_moved: int  # K/V read + query read + output written by one decode step
    triton_ms: float
    triton_gbps: float
    sdpa_ms: float
    sdpa_gbps: float
    copy_gbps: float  # (read + write) bandwidth of copying a buffer of bytes_moved bytes

    @property
    def fraction_of_copy(self) -> float:
        return self.triton_gbps / self.copy_gbps


def bench_decode(
    batch_size: int = 64,
    context_len: int = 4096,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_size: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    max_seq_len: int | None = None,
    **launch: Any,
) -> DecodeBench:
    """Benchmark ``paged_decode`` on ``batch_size`` sequences of ``context_len`` tokens.

    Blocks are assigned in a random permutation, as a long-running cache ends up. ``max_seq_len``
    (default: context_len) is the host bound that sets the number of partitions; ``launch`` goes
    to ``paged_decode`` (partition_size, block_n, num_warps, num_stages).
    """
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    blocks_per_seq = triton.cdiv(context_len, block_size)
    num_blocks = batch_size * blocks_per_seq
    cache_shape = (num_blocks, num_kv_heads, block_size, head_size)
    key_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    block_tables = block_tables.view(batch_size, blocks_per_seq)
    seq_lens = torch.full((batch_size,), context_len, dtype=torch.int32, device=device)
    query = torch.randn(batch_size, num_heads, head_size, generator=gen, device=device).to(dtype)
    out = torch.empty_like(query)
    scale = head_size**-0.5

    element_size = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * batch_size * context_len * num_kv_heads * head_size * element_size
    bytes_moved = kv_bytes + 2 * query.numel() * element_size

    def run_triton() -> None:
        paged_decode(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            scale,
            max_seq_len or context_len,
            out,
            **launch,
        )

    triton_ms = triton.testing.do_bench(run_triton, return_mode="median")

    # SDPA on contiguous K/V: each KV head's query group is its queries, so it reads K/V once.
    group = num_heads // num_kv_heads
    q = query.view(batch_size, num_kv_heads, group, head_size)
    k, v = (_contiguous_context(cache, block_tables, context_len) for cache in (key_cache, value_cache))
    sdpa_ms = triton.testing.do_bench(
        lambda: F.scaled_dot_product_attention(q, k, v, scale=scale), return_mode="median"
    )

    src = torch.empty(bytes_moved, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")

    def gbps(num_bytes: int, ms: float) -> float:
        return num_bytes / (ms * 1e-3) / 1e9

    return DecodeBench(
        bytes_moved=bytes_moved,
        triton_ms=triton_ms,
        triton_gbps=gbps(bytes_moved, triton_ms),
        sdpa_ms=sdpa_ms,
        sdpa_gbps=gbps(bytes_moved, sdpa_ms),
        copy_gbps=gbps(2 * bytes_moved, copy_ms),
    )


def _contiguous_context(cache: torch.Tensor, block_tables: torch.Tensor, context_len: int) -> torch.Tensor:
    """[num_blocks, num_kv_heads, block_size, head_size] paged -> [batch, num_kv_heads,
    context_len, head_size] contiguous, in block-table order."""
    batch_size, num_kv_heads, head_size = block_tables.shape[0], cache.shape[1], cache.shape[3]
    blocks = cache[block_tables.long()].permute(0, 2, 1, 3, 4)  # [batch, kv_heads, blocks, block_size, d]
    return blocks.reshape(batch_size, num_kv_heads, -1, head_size)[:, :, :context_len].contiguous()
