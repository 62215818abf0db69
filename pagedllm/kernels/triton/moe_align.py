"""The fused MoE's sort-and-pad (``moe_align_block_size``): the routed (token, slot) pairs grouped
by expert, each expert's run padded to a multiple of the GEMM tile's rows, on the device and
without a host sync (vLLM's ``moe_align_block_size``, MegaBlocks' padded sort, Gale et al. 2022)::

    topk_ids (flat)    2 0 2 1 0 2            (E = 3, BLOCK_M = 4)
    sorted_token_ids   1 4 . . | 3 . . . | 0 2 5 .      (. = padding, ``num_pairs``)
    expert_ids         0       | 1       | 2

Three steps: a histogram of the experts; the runs' padded lengths, their starts (a cumulative
sum) and each tile's expert; the placement of every pair at the next free slot of its expert's
run, by an atomic cursor per expert. The order of pairs within a run is whichever order the
atomics took: each row of a GEMM tile is computed alone and written to its pair's own row, so the
MoE's output is the same bits for every order.

Two launch shapes, chosen by the pair count (a shape, known on the host):

- ``_moe_align_one_program_kernel``, grid ``(1,)``, for at most ``ONE_PROGRAM_PAIRS`` pairs (a
  small decode step's): the three steps in one program, the histogram in registers, a barrier
  between the padding fill and the placement. At these sizes launches are most of the cost. On an
  H200, 20 calls in a CUDA graph, against the other shape's memset and three kernels: 64 tokens at
  top-8 of 128 experts (16-row tiles) 9.2 us against 13.5; 256 tokens of the same (32-row tiles)
  15.6 against 16.9. The one program's loops are serial, so past 2,048 pairs the launches it
  saves no longer pay for them: W6's 256 tokens at 9 slots of 17 experts (2,304 pairs) took 10.0
  against 10.4 us, and 512 tokens 15.4 against 9.7.
- Otherwise three kernels: ``_moe_count_kernel`` (grid ``(cdiv(num_pairs, BLOCK),)``: a chunk's
  histogram added with one atomic per expert, its share of the padding filled),
  ``_moe_offsets_kernel`` (one program: the runs), ``_moe_place_kernel`` (a chunk's placement).

Bound: latency. Bytes: ``num_pairs`` ids read, ``num_sorted + num_pairs`` int32 written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel

# Pairs per program of the count and place kernels, and per loop step of the one-program kernel.
_ALIGN_BLOCK = 1024
# The most pairs the one-program kernel takes: 256 tokens at top-8.
ONE_PROGRAM_PAIRS = 2048


def max_num_sorted(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Length of the sorted, padded pair list: each expert that gets pairs pads at most
    ``block_m - 1`` entries, and at most ``min(num_experts, num_pairs)`` experts get any."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(padded, block_m) * block_m


@triton.jit
def _chunk_histogram(
    topk_ids_ptr, start, num_pairs, num_experts, NUM_BINS: tl.constexpr, BLOCK: tl.constexpr
):
    """The expert histogram of pairs ``[start, start + BLOCK)``; pairs past the end go to bin
    ``num_experts``, which the callers drop."""
    offs = start + tl.arange(0, BLOCK)
    ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=num_experts).to(tl.int32)
    return tl.histogram(ids, NUM_BINS).to(tl.int32)


@triton.jit
def _fill_padding(sorted_token_ids_ptr, first, step, num_pairs, num_sorted, BLOCK: tl.constexpr):
    """Entries ``[first, first + BLOCK)``, then every ``step`` further, of the sorted list: the
    padding value."""
    for start in range(first, num_sorted, step):
        fill = start + tl.arange(0, BLOCK)
        tl.store(
            sorted_token_ids_ptr + fill, tl.full([BLOCK], 0, tl.int32) + num_pairs, mask=fill < num_sorted
        )


@triton.jit
def _write_runs(
    counts,
    cursor_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    num_experts,
    num_tiles,
    BLOCK_M: tl.constexpr,
    NUM_BINS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """From the experts' pair counts: each run padded to a multiple of BLOCK_M, the runs' starts
    (the cursors the placement advances), the end of the last run, and each tile's expert."""
    bins = tl.arange(0, NUM_BINS)
    counts = tl.where(bins < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(cursor_ptr + bins, ends - padded, mask=bins < num_experts)
    tl.store(num_post_padded_ptr, tl.sum(padded, axis=0))
    for start in range(0, num_tiles, BLOCK_T):
        tiles = start + tl.arange(0, BLOCK_T)
        # The tile's expert: how many runs end at or before its first row (tiles past the last
        # run get num_experts - 1, and the GEMMs skip them before reading it).
        ended = tl.sum(
            ((ends[None, :] <= tiles[:, None] * BLOCK_M) & (bins[None, :] < num_experts)).to(tl.int32), 1
        )
        tl.store(expert_ids_ptr + tiles, tl.minimum(ended, num_experts - 1), mask=tiles < num_tiles)


@triton.jit
def _place(topk_ids_ptr, cursor_ptr, sorted_token_ids_ptr, start, num_pairs, BLOCK: tl.constexpr):
    """Each pair of ``[start, start + BLOCK)`` takes the next free slot of its expert's run."""
    offs = start + tl.arange(0, BLOCK)
    mask = offs < num_pairs
    ids = tl.load(topk_ids_ptr + offs, mask=mask, other=0)
    slots = tl.atomic_add(cursor_ptr + ids, tl.full([BLOCK], 1, tl.int32), mask=mask)
    tl.store(sorted_token_ids_ptr + slots, offs, mask=mask)


@triton.jit(do_not_specialize=["num_pairs", "num_sorted"])
def _moe_count_kernel(
    topk_ids_ptr,
    counts_ptr,
    sorted_token_ids_ptr,
    num_pairs,
    num_experts,
    num_sorted,
    NUM_BINS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program p: add the expert histogram of pairs ``[p * BLOCK, (p + 1) * BLOCK)`` to ``counts``
    (one atomic per expert), and fill its share of the sorted list with the padding value."""
    pid = tl.program_id(0)
    bins = tl.arange(0, NUM_BINS)
    counts = _chunk_histogram(topk_ids_ptr, pid * BLOCK, num_pairs, num_experts, NUM_BINS, BLOCK)
    tl.atomic_add(counts_ptr + bins, counts, mask=bins < num_experts)
    _fill_padding(sorted_token_ids_ptr, pid * BLOCK, tl.num_programs(0) * BLOCK, num_pairs, num_sorted, BLOCK)


@triton.jit(do_not_specialize=["num_tiles"])
def _moe_offsets_kernel(
    counts_ptr,
    cursor_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    num_experts,
    num_tiles,
    BLOCK_M: tl.constexpr,
    NUM_BINS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One program: the runs (``_write_runs``) from the histogram."""
    bins = tl.arange(0, NUM_BINS)
    counts = tl.load(counts_ptr + bins, mask=bins < num_experts, other=0)
    _write_runs(
        counts, cursor_ptr, expert_ids_ptr, num_post_padded_ptr, num_experts, num_tiles,
        BLOCK_M, NUM_BINS, BLOCK_T,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_place_kernel(topk_ids_ptr, cursor_ptr, sorted_token_ids_ptr, num_pairs, BLOCK: tl.constexpr):
    """Program p: the placement of pairs ``[p * BLOCK, (p + 1) * BLOCK)``."""
    _place(topk_ids_ptr, cursor_ptr, sorted_token_ids_ptr, tl.program_id(0) * BLOCK, num_pairs, BLOCK)


@triton.jit(do_not_specialize=["num_pairs", "num_sorted", "num_tiles"])
def _moe_align_one_program_kernel(
    topk_ids_ptr,
    cursor_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    num_pairs,
    num_experts,
    num_sorted,
    num_tiles,
    BLOCK_M: tl.constexpr,
    NUM_BINS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """The whole sort-and-pad in one program: histogram, runs, padding, then placement."""
    wait_for_prior_kernel(USE_GDC)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK):
        counts += _chunk_histogram(topk_ids_ptr, start, num_pairs, num_experts, NUM_BINS, BLOCK)
    _write_runs(
        counts, cursor_ptr, expert_ids_ptr, num_post_padded_ptr, num_experts, num_tiles,
        BLOCK_M, NUM_BINS, BLOCK_T,
    )  # fmt: skip
    _fill_padding(sorted_token_ids_ptr, 0, BLOCK, num_pairs, num_sorted, BLOCK)
    # The cursors and the padding, stored by some of this program's threads, are what the
    # placement's atomics and stores (by others) then read and overwrite.
    tl.debug_barrier()
    for start in range(0, num_pairs, BLOCK):
        _place(topk_ids_ptr, cursor_ptr, sorted_token_ids_ptr, start, num_pairs, BLOCK)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the routed pairs by expert, each expert's run padded to a multiple of ``block_m``.

    topk_ids: [num_tokens, top_k]. Returns ``sorted_token_ids`` [num_sorted] int32 (flattened pair
    indices, ``num_pairs`` for padding; ``max_num_sorted`` long, fixed by the pair count so that a
    decode step captures in a CUDA graph), ``expert_ids`` [num_sorted // block_m] int32 (the
    expert of each tile) and ``num_tokens_post_padded`` [1] int32 (where the tiles in use end),
    all on the device of topk_ids.
    """
    flat_ids = topk_ids.flatten()
    num_pairs = flat_ids.numel()
    num_sorted = max_num_sorted(num_pairs, num_experts, block_m)
    device = flat_ids.device
    sorted_token_ids = torch.empty(num_sorted, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_sorted // block_m, dtype=torch.int32, device=device)
    num_post_padded = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    num_bins = triton.next_power_of_2(num_experts + 1)  # one bin more, for the masked pairs
    # A [BLOCK_T, NUM_BINS] comparison of 8K elements per loop step of the runs.
    block_t = max(16, 8192 // num_bins)
    if num_pairs <= ONE_PROGRAM_PAIRS:
        _moe_align_one_program_kernel[(1,)](
            flat_ids,
            cursor,
            sorted_token_ids,
            expert_ids,
            num_post_padded,
            num_pairs,
            num_experts,
            num_sorted,
            expert_ids.numel(),
            BLOCK_M=block_m,
            NUM_BINS=num_bins,
            BLOCK=_ALIGN_BLOCK,
            BLOCK_T=block_t,
            num_warps=8,
            **pdl_options(device),
        )
        return sorted_token_ids, expert_ids, num_post_padded
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    grid = (triton.cdiv(num_pairs, _ALIGN_BLOCK),)
    _moe_count_kernel[grid](
        flat_ids,
        counts,
        sorted_token_ids,
        num_pairs,
        num_experts,
        num_sorted,
        NUM_BINS=num_bins,
        BLOCK=_ALIGN_BLOCK,
    )
    _moe_offsets_kernel[(1,)](
        counts,
        cursor,
        expert_ids,
        num_post_padded,
        num_experts,
        expert_ids.numel(),
        BLOCK_M=block_m,
        NUM_BINS=num_bins,
        BLOCK_T=block_t,
        num_warps=8,
    )
    _moe_place_kernel[grid](flat_ids, cursor, sorted_token_ids, num_pairs, BLOCK=_ALIGN_BLOCK)
    return sorted_token_ids, expert_ids, num_post_padded
