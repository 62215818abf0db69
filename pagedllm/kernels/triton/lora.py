"""Punica's BGMV shrink and expand (Chen et al., 2023, "Punica: Multi-Tenant LoRA Serving"): every
token of a batch multiplied by its own adapter's LoRA weights, all adapters in one launch.

For token t in slot s = slots[t] (s < 0: no adapter, nothing added) and each slice i of a fused
projection (q/k/v: 3, gate/up: 2, else 1)::

    shrink:  h[t, i*R + r]   = sum_k x[t, k] * A[(i*S + s)*R + r, k]              r < R
    expand:  y[t, o]        += sum_r h[t, i(o)*R + r] * B[o, (i(o)*S + s)*R + r]   i(o): o's slice

Layouts (``lora/layers.py``'s slots): x ``[T, in]``, A ``[n*S*R, in]`` (slice-major, then slot, then
rank; a rank-r adapter zero-padded to R), B ``[out, n*S*R]`` (slice i's adapter only in slice i's
output rows), h ``[SPLIT_K, T, n*R]`` float32 partial sums, y ``[T, out]``; rows of x, h, y and of
A and B have unit column stride. ``slice_starts``: the first output row of slices 1 and 2 (``out``
past the last).

Grids: shrink ``(T, cdiv(n*R, BLOCK_N), SPLIT_K)``, each program one token's ``BLOCK_N`` outputs
over one ``in / SPLIT_K`` stretch of its adapter's A rows, in ``BLOCK_K`` chunks, written as a
partial sum; expand ``(T, cdiv(out, BLOCK_O))``, each program ``BLOCK_O`` outputs of one token: it
adds up the token's ``SPLIT_K`` partials of each slice (a fixed order: the result does not
depend on timing), then the R ranks of their slice; ``BLOCK_O`` is 64, or 256 from
``EXPAND_WIDE_TOKENS`` tokens on. A token without adapter returns at once.

Why split K: at decode a step has few tokens, and without it the shrink is ``T`` programs each
walking all of ``in`` (Llama-3.1-8B's down projection: 14336) one chunk after another, latency-
bound on one SM while the rest idle. ``SPLIT_K`` is picked so the launch has about
``TARGET_PROGRAMS`` programs (at most one per ``BLOCK_K`` chunk).

Launched with programmatic dependent launch on Hopper (``pdl.py``): each kernel is scheduled while
the kernel before it in its stream runs, and waits on the device. The expand reads its token's
slot and B before it waits (the one exception to ``pdl.py``'s rule, and a safe one: both are
copied in before the step and no kernel writes them), so at batch 1 its weight read overlaps the
kernel before it instead of following it. Inside a CUDA graph the engine runs the shrink on a side
stream beside the base projection (``lora/punica.py``): the chain of a decode step then holds one
LoRA kernel per projection, the expand.

Bound: memory. A token reads ``n*R*in + out*R`` weight elements (its own adapter's: work does
not grow with the number of slots, unlike the torch path's masked product) and writes
``n*R*SPLIT_K + out``; FLOPs ``2*(n*R*in + out*R)``. Tokens of one adapter re-read its weights
(L2 serves them within a step); SGMV (``lora_sgmv.py``) groups them, for prefill steps and for
decode steps of 16 tokens or more: the engine runs BGMV for the smaller decode steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel

# Programs a shrink launch aims for (a few per SM of an H100's 132): SPLIT_K makes up the rest.
TARGET_PROGRAMS = 512
# Tokens from which the expand's output tiles are 256 wide rather than 64.
EXPAND_WIDE_TOKENS = 16
# The shrink's chunk of ``in``.
SHRINK_BLOCK_K = 128


@triton.jit
def _lora_shrink_kernel(
    h_ptr,
    x_ptr,
    a_ptr,
    slots_ptr,
    in_features,
    k_per_split,  # a multiple of BLOCK_K
    num_slots,
    stride_x,
    stride_a,
    stride_hs,
    stride_h,
    RANK: tl.constexpr,
    NUM_COLS: tl.constexpr,  # n * RANK
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + token)
    if slot < 0:  # the expand skips the token: its h is never read
        return
    col_mask = cols < NUM_COLS
    # Row of A for output column c = i * R + r: (i * S + slot) * R + r.
    rows = ((cols // RANK) * num_slots + slot) * RANK + cols % RANK
    acc = tl.zeros([BLOCK_N], tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, in_features), BLOCK_K):
        k = k0 + offs_k
        k_mask = k < in_features
        x = tl.load(x_ptr + token * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + rows[:, None].to(tl.int64) * stride_a + k[None, :],
            mask=col_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + split * stride_hs + token * stride_h + cols, acc, mask=col_mask)


@triton.jit
def _lora_expand_kernel(
    y_ptr,
    h_ptr,
    b_ptr,
    slots_ptr,
    out_features,
    num_slots,
    slice1_start,
    slice2_start,
    split_k,
    stride_y,
    stride_hs,
    stride_h,
    stride_b,
    RANK: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two >= split_k
    BLOCK_O: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    # Before the wait: the token's slot and its adapter's B, which the step's kernels never write
    # (both are copied in before the step starts), so that under programmatic dependent launch the
    # weight read overlaps the shrink this expand waits for (at batch 1 the whole expand is little
    # more than that read's latency). h and y are read after it.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_mask = offs_o < out_features
    slice_index = (offs_o >= slice1_start).to(tl.int32) + (offs_o >= slice2_start).to(tl.int32)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < RANK
    mask = o_mask[:, None] & r_mask[None, :]
    b_cols = (slice_index[:, None] * num_slots + slot) * RANK + offs_r[None, :]
    b_ptrs = b_ptr + offs_o[:, None].to(tl.int64) * stride_b + b_cols
    has_slot = (tl.zeros([BLOCK_O, BLOCK_R], tl.int64) + slot) >= 0
    b = tl.load(b_ptrs, mask=mask & has_slot, other=0.0).to(tl.float32)
    wait_for_prior_kernel(USE_GDC)
    if slot < 0:
        return
    # h of each slice: the sum of its split-K partials [BLOCK_S, BLOCK_R], spread over the rows
    # of that slice.
    offs_s = tl.arange(0, BLOCK_S)
    h_tile_mask = (offs_s < split_k)[:, None] & r_mask[None, :]
    h = tl.zeros([BLOCK_O, BLOCK_R], tl.float32)
    for i in tl.static_range(NUM_SLICES):
        partials = tl.load(
            h_ptr + offs_s[:, None] * stride_hs + token * stride_h + i * RANK + offs_r[None, :],
            mask=h_tile_mask,
            other=0.0,
        )
        h = tl.where((slice_index == i)[:, None], tl.sum(partials, axis=0)[None, :], h)
    delta = tl.sum(b * h, axis=1)
    y_ptrs = y_ptr + token * stride_y + offs_o
    y = tl.load(y_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=o_mask)


def lora_shrink_expand(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    num_slots: int,
    rank: int,
    slice_starts: tuple[int, int],
) -> None:
    """y [T, out] += each token's own adapter's (x A^T) B^T, in place (layouts: module docstring).

    token_slots: [T] int32/int64, each token's slot or -1; slice_starts: the first output row of
    slices 1 and 2 (``out`` for a slice that does not exist)."""
    h = bgmv_partials(x, lora_a, num_slots)
    bgmv_shrink(h, x, lora_a, token_slots, num_slots, rank)
    bgmv_expand(y, h, lora_b, token_slots, num_slots, rank, slice_starts)


def bgmv_partials(x: torch.Tensor, lora_a: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The shrink's output h ``[SPLIT_K, T, n*R]`` float32, uninitialised. Allocated apart from
    the launch so that a caller running the shrink on another stream keeps h in its own stream's
    memory."""
    num_tokens, in_features = x.shape
    num_cols = lora_a.shape[0] // num_slots  # n * R
    split_k = _shrink_split_k(num_tokens, num_cols, in_features)
    return torch.empty(split_k, num_tokens, num_cols, dtype=torch.float32, device=x.device)


def _shrink_block_n(num_cols: int) -> int:
    return min(triton.next_power_of_2(num_cols), 64)


def _shrink_split_k(num_tokens: int, num_cols: int, in_features: int) -> int:
    """SPLIT_K: about ``TARGET_PROGRAMS`` programs in all, each over whole BLOCK_K chunks (as
    many as ``cdiv(chunks, SPLIT_K)``, which gives back the same SPLIT_K)."""
    num_chunks = triton.cdiv(in_features, SHRINK_BLOCK_K)
    num_col_blocks = triton.cdiv(num_cols, _shrink_block_n(num_cols))
    wanted = triton.cdiv(TARGET_PROGRAMS, max(num_tokens, 1) * num_col_blocks)
    return triton.cdiv(num_chunks, triton.cdiv(num_chunks, min(num_chunks, wanted)))


def bgmv_shrink(
    h: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    num_slots: int,
    rank: int,
) -> None:
    """h (``bgmv_partials``) = each token's split-K partials of x A^T (layouts: module docstring)."""
    split_k, num_tokens, num_cols = h.shape
    in_features = x.shape[1]
    assert lora_a.shape == (num_cols * num_slots, in_features) and num_cols % rank == 0
    assert token_slots.shape[0] >= num_tokens and x.shape[0] == num_tokens
    assert x.stride(1) == 1 and lora_a.stride(1) == 1
    if num_tokens == 0:
        return
    block_n = _shrink_block_n(num_cols)
    chunks_per_split = triton.cdiv(triton.cdiv(in_features, SHRINK_BLOCK_K), split_k)
    _lora_shrink_kernel[(num_tokens, triton.cdiv(num_cols, block_n), split_k)](
        h, x, lora_a, token_slots, in_features, chunks_per_split * SHRINK_BLOCK_K, num_slots,
        x.stride(0), lora_a.stride(0), h.stride(0), h.stride(1),
        RANK=rank, NUM_COLS=num_cols, BLOCK_N=block_n, BLOCK_K=SHRINK_BLOCK_K, **pdl_options(x.device),
    )  # fmt: skip


def bgmv_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    num_slots: int,
    rank: int,
    slice_starts: tuple[int, int],
) -> None:
    """y += each token's h (``bgmv_shrink``'s) times its adapter's B^T, in place."""
    split_k, num_tokens, num_cols, out_features = expand_shapes(y, h, lora_b, num_slots)
    if num_tokens == 0:
        return
    # Few tokens: narrow output tiles, for programs enough to fill the GPU; many tokens: wide
    # ones, so the launch is not mostly per-program overhead (T * out / 64 programs of 64 x R).
    block_o = 64 if num_tokens < EXPAND_WIDE_TOKENS else 256
    _lora_expand_kernel[(num_tokens, triton.cdiv(out_features, block_o))](
        y, h, lora_b, token_slots, out_features, num_slots, slice_starts[0], slice_starts[1], split_k,
        y.stride(0), h.stride(0), h.stride(1), lora_b.stride(0),
        RANK=rank, NUM_SLICES=num_cols // rank, BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_S=triton.next_power_of_2(split_k), BLOCK_O=block_o, **pdl_options(y.device),
    )  # fmt: skip


def expand_shapes(
    y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, num_slots: int
) -> tuple[int, int, int, int]:
    """An expand's (SPLIT_K, T, n*R, out), its operands' layouts checked."""
    split_k, num_tokens, num_cols = h.shape
    out_features = y.shape[1]
    assert lora_b.shape == (out_features, num_cols * num_slots) and y.shape[0] == num_tokens
    assert y.stride(1) == 1 and lora_b.stride(1) == 1
    return split_k, num_tokens, num_cols, out_features
