"""The CUDA kernels from Python: the cache write, PagedAttention V1 and V2, and the choice of one.

Every function builds the extension on its first call (``build.load``). The arguments are checked
in C++ (``csrc/binding.cpp``): a RuntimeError names the offending tensor, a ValueError a head or
block size the kernels were not built for.
The attention functions share the Triton ``paged_decode``'s signature, so benchmarks and backends
can swap them. Layouts: ``pagedllm.kernels.cuda.layout``.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from pagedllm.kernels.cuda.build import load

# What the kernels are instantiated for (csrc/dispatch_utils.cuh): the supported grid, nothing more,
# since every combination costs build time.
SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Tokens per V2 partition: kPartitionSize in csrc/ops.h (the built module's PARTITION_SIZE).
PARTITION_SIZE = 512

# V1 or V2, vLLM's rule as its code states it (write-ups shorten it to "V1 under 8192 tokens or
# when num_seqs * num_heads > 512"): V1 when no sequence is longer than V1_MAX_SEQ_LEN and either a
# single partition covers every context (V2 would only add its reduce) or the batch has more than
# V1_MIN_SEQS_X_HEADS (sequence, head) thread blocks to fill the GPU with. Otherwise a small batch
# of long contexts needs V2's split to occupy every SM. Checked against K1 on an H200 (2026-11-21,
# benchmarks/RESULTS.md): V1 is faster at contexts 512, 4096 and ragged 1-8192 and V2 at 16384,
# as this rule chooses; vLLM's shortened form would have chosen V1 there (64 x 32 > 512).
V1_MAX_SEQ_LEN = 8192
V1_MIN_SEQS_X_HEADS = 512


def use_v1(max_seq_len: int, num_seqs: int, num_heads: int) -> bool:
    """Whether ``paged_attention`` runs V1 (else V2) for this decode batch (host ints: no sync)."""
    max_num_partitions = -(-max_seq_len // PARTITION_SIZE)
    return max_seq_len <= V1_MAX_SEQ_LEN and (
        max_num_partitions == 1 or num_seqs * num_heads > V1_MIN_SEQS_X_HEADS
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V at its slot; slots < 0 are padding and are skipped.

    key, value: [num_tokens, num_kv_heads, head_size] (any token stride); key_cache: [num_blocks,
    num_kv_heads, head_size / x, block_size, x]; value_cache: [num_blocks, num_kv_heads, head_size,
    block_size]; slot_mapping: [num_tokens] int64.
    """
    load().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor,
    alibi_slopes: torch.Tensor | None = None,
    *,
    version: Literal["v1", "v2"] | None = None,
) -> torch.Tensor:
    """Attention of each sequence's single new query over its paged context; writes and returns
    ``out``. V1 runs one thread block per (query head, sequence); V2 splits each context into
    ``PARTITION_SIZE``-token partitions computed by separate thread blocks, then merges them.
    ``version`` None: as ``use_v1`` chooses (``paged_attention_v1``/``_v2`` fix it).

    query, out: [num_seqs, num_heads, head_size] (query: any token stride, 16-byte aligned rows;
    out contiguous); caches in vLLM's original layout; block_tables: [num_seqs, max_blocks] int32;
    seq_lens: [num_seqs] int32, each in [1, max_seq_len]: ``max_seq_len`` (a host int, e.g.
    max_model_len under CUDA graphs) bounds every seq_len; it sizes V1's shared memory and sets
    V2's number of partitions (the float32 workspace is ``num_seqs * num_heads * cdiv(max_seq_len,
    PARTITION_SIZE) * (head_size + 2)`` floats); alibi_slopes: [num_heads] float32, or None.
    """
    if version is None:
        version = "v1" if use_v1(max_seq_len, query.shape[0], query.shape[1]) else "v2"
    run = load().paged_attention_v1 if version == "v1" else load().paged_attention_v2
    run(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, out, alibi_slopes)
    return out


paged_attention_v1 = functools.partial(paged_attention, version="v1")
paged_attention_v2 = functools.partial(paged_attention, version="v2")
