"""Launch parameters of the paged attention kernels, per head size and dtype: the table the
attention backend launches with and the kernel benchmark measures at."""

from __future__ import annotations

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
