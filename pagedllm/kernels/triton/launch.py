"""Launch parameters of the paged attention kernels, per head size and dtype: the table the
attention backend launches with and the kernel benchmark measures at."""

from __future__ import annotations

import functools
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
    """Launch parameters of ``paged_prefill`` (query rows and keys per tile, warps, stages)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def default_launches(head_size: int, dtype: torch.dtype) -> tuple[DecodeLaunch, PrefillLaunch]:
    """Tiles that fit registers and shared memory on Hopper (checked with ptxas for sm_90: no
    spills), per head size and dtype. Tuning for speed is done on the device with
    ``pagedllm bench kernels --sweep``."""
    if dtype == torch.float32:
        # Exact float32 dots run on FMA units, not tensor cores, and need far more registers: a
        # correctness path (and the oracle's dtype), so small tiles and 8 warps.
        return DecodeLaunch(block_n=32, num_warps=8), PrefillLaunch(block_m=32, block_n=16, num_warps=8)
    if head_size > 128:
        # Halve the key tile and double the warps: 64 x 256 K and V tiles per pipeline stage spill.
        return DecodeLaunch(block_n=32), PrefillLaunch(block_n=32, num_warps=8)
    return DecodeLaunch(), PrefillLaunch()


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# (sequence, KV head) pairs per SM from which a decode batch is left unsplit.
_UNSPLIT_PAIRS_PER_SM = 8


def decode_partition_size(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, launch: dict[str, int], device: torch.device
) -> int:
    """Context tokens per decode program.

    A large batch has enough (sequence, KV head) pairs to fill the GPU by itself: splitting its
    contexts would only add the reduce pass and its float32 partials, so one partition covers
    ``max_seq_len`` (K1 at W1's shape, 2,048 pairs on 132 SMs, contexts up to 1,280: 5% faster
    than 1,024-token partitions and their reduce). A small batch has few pairs: unsplit, a single
    request's decode runs on a handful of SMs and each layer's attention waits on the latency of
    one long loop, so the partition (at most ``launch["partition_size"]``) is halved until every
    SM has about two programs.
    """
    partition = launch["partition_size"]
    floor = launch["block_n"]
    num_pairs = num_seqs * num_kv_heads
    if device.type != "cuda":
        return partition
    num_sms = _num_sms(device)
    if num_pairs >= _UNSPLIT_PAIRS_PER_SM * num_sms:
        return max(partition, -(-max_seq_len // floor) * floor)
    while partition > floor and num_pairs * -(-max_seq_len // partition) < 2 * num_sms:
        partition //= 2
    return max(partition, floor)
