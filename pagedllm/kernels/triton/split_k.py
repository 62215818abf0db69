"""Split-K inside one launch, shared by the GEMMs that cut K across programs (the batch-invariant
matmul and the few-token quantized GEMM): each program of an output tile's splits writes its
float32 partial sum, counts itself in on the tile's arrival counter, and the program that arrives
last (whichever split it is) adds the tile's partials in split order and writes the output.

Why not ``tl.atomic_add`` into a zeroed output: the order of the adds would follow the programs'
timing (bits that change run to run), and the output would need a zeroing launch and a cast
launch around the GEMM. Here the sum's order is fixed and the counters reset themselves: the last
program sets its tile's counter back to 0, so they stay zero between launches (and between the
replays of a CUDA graph) with no launch of their own.

Layouts: partials ``[num_splits, M, N]`` float32 (``stride_ps`` between splits); counters int32,
one per output tile, made once per device by ``arrival_counters``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


# At least this many counters per device: the largest layer's tiles (a 128,256-row vocabulary in
# 32-row tiles is 4,008) fit with room, so the first allocation, made before any CUDA graph is
# captured, is the only one.
_MIN_COUNTERS = 16384
_counters: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, num_tiles: int) -> torch.Tensor:
    """The split-in-grid launches' tile counters on ``device``, at least ``num_tiles`` of them:
    zeroed once and left at zero by every launch. Layers call it when their weights are processed
    (``reserve``), so no launch inside a CUDA graph capture allocates them."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < num_tiles:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        assert not capturing, "arrival counters made during a CUDA graph capture"
        counters = _counters[device] = torch.zeros(
            max(num_tiles, _MIN_COUNTERS, num_sms(device)), dtype=torch.int32, device=device
        )
    return counters


@triton.jit
def sum_splits_in_order(acc, partial_ptrs, stride_ps, mask, counter_ptr, num_splits):
    """Store this program's partial ``acc`` as split ``tl.program_id(2)`` of its tile; return
    (whether this program arrived last, the tile's sum over the splits in split order when it
    did). ``partial_ptrs``: the tile's elements in split 0 (64-bit pointers); ``counter_ptr``:
    the tile's counter."""
    split = tl.program_id(2)
    # int64: splits x M x N partials can pass 2**31 elements (a vocabulary-sized N).
    tl.store(partial_ptrs + split.to(tl.int64) * stride_ps, acc, mask=mask)
    # Every thread's stores before the release (acq_rel) of the count: the last to arrive
    # acquires them all.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    last = arrived == num_splits - 1
    total = acc
    if last:
        # .cg: from L2, where the other SMs' partials are, never a stale L1 line. The first split
        # starts the sum (not 0 + partial[0], which would turn -0.0 into +0.0).
        total = tl.load(partial_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        for _ in range(1, num_splits):
            partial_ptrs += stride_ps  # a 64-bit pointer: no int32 product to overflow
            total += tl.load(partial_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter_ptr, 0)
    return last, total
