"""Launch parameters of the paged attention kernels, per head size and dtype: the table the
attention backend launches with and the kernel benchmark measures at."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeLaunch:
    """Launch parameters of ``paged_decode`` (tokens per partition and per tile, warps, stages).

    ``partition_size`` is the largest one used; each launch may split the context finer (see
    ``decode_partition_size``).
    """

    partition_size: int = 1024
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class PrefillLaunch:
    """Launch parameters of ``paged_prefill`` (query rows and keys per tile, warps, stages, and
    whether a tile's rows are (token, head) pairs of one KV group, ``pack_gqa``)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    pack_gqa: bool = False


def default_launches(head_size: int, dtype: torch.dtype) -> tuple[DecodeLaunch, PrefillLaunch]:
    """Tiles that fit registers and shared memory on Hopper (checked with ptxas for sm_90: no
    spills), per head size and dtype. Tuning for speed is done on the device with
    ``pagedllm bench kernels --sweep``."""
    if dtype == torch.float32:
        # Exact float32 dots run on FMA units, not tensor cores, and need far more registers: a
        # correctness path (and the oracle's dtype), so small tiles and 8 warps.
        return DecodeLaunch(block_n=32, num_warps=8), PrefillLaunch(block_m=32, block_n=16, num_warps=8)
    if head_size > 128:
        # Halve the key tile: 64 x 256 K and V tiles per pipeline stage spill. The prefill's tiles
        # hold a KV group's heads, which share each K/V tile read: at W6's prefill step (29 prompts
        # of 100 to 1,024 tokens, 16 query and 2 KV heads of 256, bf16) on an H200, timed in a CUDA
        # graph, 392 us against 449 with one head a tile and 894 with 8 warps.
        return DecodeLaunch(block_n=32), PrefillLaunch(block_n=32, pack_gqa=True)
    return DecodeLaunch(), PrefillLaunch()


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# (sequence, KV head) pairs per SM from which a decode batch is left unsplit.
_UNSPLIT_PAIRS_PER_SM = 8
# What splitting an equal-length batch costs (the reduce pass, the partials, a pipeline prologue per
# program): K1 at 4,096 tokens on an H200, 272.7 us in 1,024-token partitions against 256.1 unsplit.
_SPLIT_OVERHEAD = 0.06


def decode_partition_size(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    launch: dict[str, int],
    device: torch.device,
    min_seq_len: int = 0,
) -> int:
    """Context tokens per decode program.

    Splitting a context into partitions serves two ends: filling the GPU when a batch has few
    (sequence, KV head) pairs, and balancing it when its contexts differ in length (a long context
    in short partitions spreads over many SMs instead of finishing last). It costs the reduce pass
    and its float32 partials, and a pipeline prologue per program. So:

    - A large batch (``_UNSPLIT_PAIRS_PER_SM`` pairs per SM) fills the GPU by itself: one partition
      covers ``max_seq_len`` (K1 at W1's shape, 2,048 pairs on 132 SMs, contexts up to 1,280: 5%
      faster than 1,024-token partitions and their reduce).
    - A batch whose contexts are equal (``min_seq_len``, a host value the caller may know, within
      1/8 of ``max_seq_len``) has nothing to balance. It stays unsplit when its pairs give every
      SM two programs or more and spread evenly enough: the fullest SM runs ``ceil(pairs / SMs)``
      equal programs where ``pairs / SMs`` would be even, a loss that must stay under
      ``_SPLIT_OVERHEAD``. K1 at 4,096 and 16,384 tokens (512 pairs on 132 SMs, a 3% loss):
      256.1 and 959.9 us unsplit against 267.7 and 971.6 at their best split. 0 means unknown (a
      CUDA graph, captured for every length).
    - Otherwise the partition (at most ``launch["partition_size"]``) is halved until every SM has
      about two programs: unsplit, a single request's decode would run on a handful of SMs, and a
      ragged batch would wait on its longest contexts (K1 with contexts uniform in [1, 8,192]:
      291.9 us in 1,024-token partitions, 334.3 in 4,096-token ones).
    """
    partition = launch["partition_size"]
    floor = launch["block_n"]
    num_pairs = num_seqs * num_kv_heads
    if device.type != "cuda":
        return partition
    num_sms = _num_sms(device)
    unsplit = max(partition, -(-max_seq_len // floor) * floor)
    if num_pairs >= _UNSPLIT_PAIRS_PER_SM * num_sms:
        return unsplit
    if 8 * min_seq_len >= 7 * max_seq_len and num_pairs >= 2 * num_sms:
        per_sm = num_pairs / num_sms
        if math.ceil(per_sm) / per_sm - 1 <= _SPLIT_OVERHEAD:
            return unsplit
    while partition > floor and num_pairs * -(-max_seq_len // partition) < 2 * num_sms:
        partition //= 2
    return max(partition, floor)
