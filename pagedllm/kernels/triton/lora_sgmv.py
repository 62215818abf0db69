"""Punica's SGMV shrink and expand (Chen et al., 2023, "Punica: Multi-Tenant LoRA Serving"; S-LoRA,
Sheng et al., 2023): the tokens of a step grouped by adapter into segments, each segment's LoRA
product done as small GEMMs (``tl.dot``) so that an adapter's A and B are read once per tile of
``BLOCK_M`` tokens rather than once per token (BGMV, ``lora.py``).

The contract is BGMV's (layouts there): for token t in slot s (none: nothing added) and slice i,

    shrink:  h[t, i*R + r]  = sum_k x[t, k] * A[(i*S + s)*R + r, k]
    expand:  y[t, o]       += sum_r h[t, i(o)*R + r] * B[o, (i(o)*S + s)*R + r]

Segments and tiles (``SegmentPlan``, built once per step on the host, not per layer, into a
``SegmentBuffer`` at fixed addresses): ``sorted_tokens [T]`` the step's token indices ordered by
slot (tokens without adapter first, outside every segment); slot s's segment is ``seg_len[s]``
tokens from ``seg_start[s]``; each segment is cut into tiles of ``BLOCK_M`` tokens, tile j being
``BLOCK_M`` rows from ``tile_m0[j]`` of slot ``tile_slot[j]``'s segment. A prefill step's grids
run over exactly its tiles: an empty segment has none, and a long one does not make the short
ones launch idle programs. A decode step's grids run over the most tiles its token count can make
(``max_tiles``; the entries past its tiles hold slot -1 and their programs return at once), so a
CUDA graph captured at a token count replays every later step of that count.

Grids (BLOCK_M 64, or 16 when 64 would give the shrink too few programs, ``_block_m``; always 16
at decode):
  shrink ``(tiles, SPLIT_K)``: a program gathers its tile's x rows and accumulates ``[BLOCK_M,
  n*R]`` over its stretch of ``in`` (all of it at SPLIT_K 1), in ``BLOCK_K`` chunks, against its
  slot's A rows of all n slices at once (x read once for a fused projection); the partial h is
  scattered back in token order, h ``[SPLIT_K, T, n*R]`` float32. SPLIT_K (at most
  ``MAX_SPLIT_K``) brings the programs to about ``TARGET_PROGRAMS`` when the tiles are fewer: a
  decode step of 256 tokens has 16 to 24 tiles, each of which would otherwise walk all of ``in``.
  expand ``(tiles, cdiv(out, BLOCK_O))``, BLOCK_O 64: a program takes its tile's tokens and
  ``BLOCK_O`` outputs; for each slice whose rows meet the tile, it adds up the slice's SPLIT_K
  partials of h (in split order: the result does not depend on timing), then ``[BLOCK_M, R] @
  [R, BLOCK_O]``; it adds the sum to y (read, add, write).

Compiled variants: Triton compiles a kernel once per set of constexprs (BLOCK_M; per projection
RANK, NUM_COLS, NUM_SLICES) and per specialisation of its other arguments (an integer equal to 1
or a multiple of 16, a pointer 16-byte aligned or not). The projection's sizes and strides are
fixed, the plan's arrays start on 16-byte boundaries, the split count and h's split stride are
not specialised on, so what varies from step to step is the tile height (``BLOCK_MS``) and
whether K is split (``SPLIT``; only with tiles of 16, the split variant at most
``MAX_SPLIT_K`` ways): three variants of each kernel per projection, which ``warm_up`` compiles
when the engine starts, not in the middle of a timed step. (A split count in the constexprs
would make one variant per count; the expand's unrolled sum of partials is the price, which the
unsplit variants do not pay: at 64-token tiles their registers stay those of the kernels without
split, no spills on sm_90.)

Bytes and FLOPs per step (T tokens in g segments, n slices): FLOPs ``2*T*R*(n*in + out)``, as
BGMV; weight bytes ``sum over segments of ceil(len/BLOCK_M) * (n*R*in + R*out)`` elements against
BGMV's ``T * (n*R*in + R*out)``: a 4096-token prefill of 8 adapters reads each adapter's weights
once per tile of 16 tokens instead of once per token, a 256-token decode step of 8 adapters 16 to
24 times instead of 256. Activation bytes: x once, h twice (SPLIT_K times), y twice.

Which runs (``LoRABatch.set_token_slots``, once per step): a step with prefill chunks runs SGMV
over its exact tiles; a decode-only step (every request one token, or a padded CUDA-graph batch)
runs SGMV over the fixed grid from 16 tokens on, and BGMV below (too few tokens to share an
adapter's weights; BGMV's per-token programs spread the work wider).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.lora import expand_shapes
from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel


@triton.jit
def _tile_rows(tile, slot, tile_m0_ptr, sorted_tokens_ptr, seg_start_ptr, seg_len_ptr, BLOCK_M: tl.constexpr):
    """Tile ``tile`` (of slot ``slot``)'s rows: their token indices (int64) and which rows exist."""
    offs_m = tl.load(tile_m0_ptr + tile) + tl.arange(0, BLOCK_M)
    m_mask = offs_m < tl.load(seg_len_ptr + slot)
    tokens = tl.load(sorted_tokens_ptr + tl.load(seg_start_ptr + slot) + offs_m, mask=m_mask, other=0)
    return tokens.to(tl.int64), m_mask


@triton.jit(do_not_specialize=["stride_hs"])
def _sgmv_shrink_kernel(
    h_ptr,
    x_ptr,
    a_ptr,
    tile_slot_ptr,
    tile_m0_ptr,
    sorted_tokens_ptr,
    seg_start_ptr,
    seg_len_ptr,
    in_features,
    k_per_split,  # a multiple of BLOCK_K
    num_slots,
    stride_x,
    stride_a,
    stride_hs,  # T * NUM_COLS: varies with the step, so not specialised on
    stride_h,
    RANK: tl.constexpr,
    NUM_COLS: tl.constexpr,  # n * RANK
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # next power of two >= NUM_COLS, >= 16 (tl.dot's least size)
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 weights (exact as the torch path), else "tf32"
    SPLIT: tl.constexpr,  # K split over the grid's second axis (else one program walks all of in)
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:  # a tile past the step's, in a grid fixed by the token count (CUDA graphs)
        return
    tokens, m_mask = _tile_rows(
        tile, slot, tile_m0_ptr, sorted_tokens_ptr, seg_start_ptr, seg_len_ptr, BLOCK_M
    )
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < NUM_COLS
    # Row of A for column c = i * R + r: (i * S + slot) * R + r (every slice's rows at once).
    rows = ((cols // RANK) * num_slots + slot) * RANK + cols % RANK
    offs_k = tl.arange(0, BLOCK_K)
    split = tl.program_id(1) if SPLIT else 0
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features) if SPLIT else in_features
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < in_features
        x_mask = m_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + tokens[:, None] * stride_x + k[None, :], mask=x_mask, other=0.0)
        a = tl.load(
            a_ptr + rows[None, :].to(tl.int64) * stride_a + k[:, None],
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: A^T's tile
        acc = tl.dot(x, a, acc, input_precision=PRECISION)
    h_mask = m_mask[:, None] & col_mask[None, :]
    tl.store(h_ptr + split * stride_hs + tokens[:, None] * stride_h + cols[None, :], acc, mask=h_mask)


@triton.jit(do_not_specialize=["split_k", "stride_hs"])
def _sgmv_expand_kernel(
    y_ptr,
    h_ptr,
    b_ptr,
    tile_slot_ptr,
    tile_m0_ptr,
    sorted_tokens_ptr,
    seg_start_ptr,
    seg_len_ptr,
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
    SPLIT: tl.constexpr,  # h in split_k partials, else one
    MAX_SPLIT_K: tl.constexpr,  # the most partials
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,  # next power of two >= RANK, >= 16
    BLOCK_O: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    tokens, m_mask = _tile_rows(
        tile, slot, tile_m0_ptr, sorted_tokens_ptr, seg_start_ptr, seg_len_ptr, BLOCK_M
    )
    o0 = tl.program_id(1) * BLOCK_O
    offs_o = o0 + tl.arange(0, BLOCK_O)
    offs_r = tl.arange(0, BLOCK_R)
    h_mask = m_mask[:, None] & (offs_r < RANK)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_O], tl.float32)
    for i in tl.static_range(NUM_SLICES):
        # Slice i's output rows [start, end): 0, slice1_start, slice2_start, out_features.
        start = 0 if i == 0 else (slice1_start if i == 1 else slice2_start)
        end = slice1_start if i == 0 else (slice2_start if i == 1 else out_features)
        if (start < o0 + BLOCK_O) & (end > o0):  # the slice meets this tile
            o_mask = (offs_o >= start) & (offs_o < end)
            h_ptrs = h_ptr + tokens[:, None] * stride_h + i * RANK + offs_r[None, :]
            h = tl.load(h_ptrs, mask=h_mask, other=0.0)
            if SPLIT:
                # The slice's other split-K partials, added in split order (unrolled, so the
                # loads are in flight together; splits past split_k are masked off).
                for split in tl.static_range(1, MAX_SPLIT_K):
                    in_split = tl.full([BLOCK_M, BLOCK_R], split, tl.int32) < split_k
                    h += tl.load(h_ptrs + split * stride_hs, mask=h_mask & in_split, other=0.0)
            b_cols = (i * num_slots + slot) * RANK + offs_r
            b = tl.load(
                b_ptr + offs_o[None, :].to(tl.int64) * stride_b + b_cols[:, None],
                mask=(offs_r < RANK)[:, None] & o_mask[None, :],
                other=0.0,
            )  # [BLOCK_R, BLOCK_O]: B^T's tile
            acc = tl.dot(h.to(b.dtype), b, acc, input_precision=PRECISION)
    y_mask = m_mask[:, None] & (offs_o < out_features)[None, :]
    y_ptrs = y_ptr + tokens[:, None] * stride_y + offs_o[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


# Shrink programs a launch aims for (a few per SM of an H100's 132); BLOCK_M shrinks, then K
# splits, to get them.
TARGET_PROGRAMS = 256
# The tile heights a plan may choose, largest first. Each is a compiled variant of both kernels
# for every projection shape, so there are two, not one per power of two: ``warm_up`` compiles
# them all when the engine starts.
BLOCK_MS = (64, 16)
BLOCK_K = 64
# The most stretches of ``in`` the shrink splits into: the expand adds that many partials of h
# (a bound fixed at compile time, so that the split count, which follows the step's size, is no
# compile key: a launch is split or not, a variant each).
MAX_SPLIT_K = 8
# Outputs per expand program (128 would read h half as often, but a 64-token tile's accumulator
# and y then spill registers on sm_90).
EXPAND_BLOCK_O = 64
# The plan's arrays start on 16-byte boundaries: Triton specialises a kernel on whether each
# pointer argument is 16-byte aligned.
_ALIGN = 16 // 4  # int32 elements


def _block_m(seg_len: np.ndarray) -> int:
    """Tokens per tile: 64 (weights read least often) unless that leaves the shrink, which walks
    all of ``in`` per program, too few programs to fill the GPU; then 16 (tl.dot's least)."""
    big, small = BLOCK_MS
    return big if (-(-seg_len // big)).sum() >= TARGET_PROGRAMS else small


def max_tiles(num_tokens: int, block_m: int, num_slots: int) -> int:
    """The most tiles ``num_tokens`` tokens over ``num_slots`` slots can make: each segment's
    last tile may be partial."""
    return -(-num_tokens // block_m) + min(num_slots, num_tokens)


@dataclass
class SegmentPlan:
    """A step's tokens grouped by slot and cut into tiles, in a ``SegmentBuffer``.

    sorted_tokens: token indices by slot (tokens without adapter first, in no segment), the first
    ``num_tokens``; seg_start, seg_len: [S], slot s's run in ``sorted_tokens``; tile_slot,
    tile_m0: each tile's slot and first row in its segment, the first ``num_tiles`` (slot -1 past
    them); block_m: rows per tile. fixed_grid: the launches take ``max_tiles`` of the token count
    (the programs past the step's tiles return at once), so that a CUDA graph captured at that
    count replays any step's plan; else exactly ``num_tiles``."""

    sorted_tokens: torch.Tensor
    seg_start: torch.Tensor
    seg_len: torch.Tensor
    tile_slot: torch.Tensor
    tile_m0: torch.Tensor
    num_tokens: int
    num_tiles: int
    block_m: int
    fixed_grid: bool = False

    def grid_tiles(self, num_tokens: int) -> int:
        """Tile programs of a launch over ``num_tokens`` tokens."""
        if self.fixed_grid:
            return max_tiles(num_tokens, self.block_m, self.seg_len.shape[0])
        return self.num_tiles


class SegmentBuffer:
    """Where a step's ``SegmentPlan`` lives on the device: the five arrays at fixed offsets of
    one int32 buffer (a captured CUDA graph reads the same addresses at every replay), each from
    a 16-byte boundary, filled by one host-to-device copy per step. Every tile entry past a
    step's tiles holds slot -1.

    Args:
        max_num_tokens: most tokens in a step.
        num_slots: S."""

    def __init__(self, max_num_tokens: int, num_slots: int, device: torch.device) -> None:
        self.max_num_tokens, self.num_slots, self.device = max_num_tokens, num_slots, device
        capacity = max_tiles(max_num_tokens, min(BLOCK_MS), num_slots)
        # seg_start, seg_len, tile_slot, tile_m0, sorted_tokens: the token-sized array last, so a
        # step's copy covers the others and only its own tokens.
        sizes = (num_slots, num_slots, capacity, capacity, max_num_tokens)
        self._starts = np.cumsum([0] + [-(-n // _ALIGN) * _ALIGN for n in sizes])
        self._buffer = torch.full((int(self._starts[-1]),), -1, dtype=torch.int32, device=device)
        self._views = [self._buffer[start : start + n] for start, n in zip(self._starts, sizes)]

    def plan(
        self, token_slots: np.ndarray, block_m: int | None = None, fixed_grid: bool = False
    ) -> SegmentPlan:
        """token_slots: [T] each token's slot or -1 -> its segments and tiles, written here.
        block_m: the tile height (default: ``_block_m``'s choice)."""
        token_slots = np.asarray(token_slots, dtype=np.int64)
        num_tokens = len(token_slots)
        assert num_tokens <= self.max_num_tokens, (num_tokens, self.max_num_tokens)
        order = np.argsort(token_slots, kind="stable")  # -1 first, then slot 0, 1, ...
        seg_len = np.bincount(token_slots[token_slots >= 0], minlength=self.num_slots)
        seg_start = (token_slots < 0).sum() + np.concatenate(([0], np.cumsum(seg_len)[:-1]))
        if block_m is None:
            block_m = _block_m(seg_len)
        tiles = -(-seg_len // block_m)  # [S] tiles per segment
        tile_slot = np.repeat(np.arange(self.num_slots), tiles)
        # A tile's index within its segment, times BLOCK_M.
        tile_m0 = (np.arange(len(tile_slot)) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * block_m
        used = int(self._starts[4]) + num_tokens
        host = np.full(used, -1, dtype=np.int32)
        for part, start in zip((seg_start, seg_len, tile_slot, tile_m0, order), self._starts):
            host[start : start + len(part)] = part
        staging = torch.from_numpy(host)
        if self.device.type != "cpu":
            # Pinned: one asynchronous copy (a pageable one would wait for the device to drain;
            # the caching host allocator keeps the staging tensor until its copy has run).
            staging = staging.pin_memory()
        self._buffer[:used].copy_(staging, non_blocking=True)
        seg_start_view, seg_len_view, tile_slot_view, tile_m0_view, tokens_view = self._views
        return SegmentPlan(
            tokens_view, seg_start_view, seg_len_view, tile_slot_view, tile_m0_view,
            num_tokens, len(tile_slot), block_m, fixed_grid,
        )  # fmt: skip


def plan_segments(
    token_slots: np.ndarray, num_slots: int, device: torch.device, block_m: int | None = None
) -> SegmentPlan:
    """A step's plan in a buffer of its own (``SegmentBuffer.plan``), its grid its tiles."""
    return SegmentBuffer(len(token_slots), num_slots, device).plan(token_slots, block_m)


def lora_sgmv_shrink_expand(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    plan: SegmentPlan,
    num_slots: int,
    rank: int,
    slice_starts: tuple[int, int],
) -> None:
    """y [T, out] += each token's own adapter's (x A^T) B^T, in place, segment by segment
    (layouts: ``lora.py``'s docstring; ``plan``: the step's segments)."""
    h = sgmv_partials(x, lora_a, plan, num_slots)
    sgmv_shrink(h, x, lora_a, plan, num_slots, rank)
    sgmv_expand(y, h, lora_b, plan, num_slots, rank, slice_starts)


def sgmv_partials(
    x: torch.Tensor, lora_a: torch.Tensor, plan: SegmentPlan, num_slots: int, split_k: int | None = None
) -> torch.Tensor:
    """The shrink's output h ``[SPLIT_K, T, n*R]`` float32, uninitialised (allocated apart from
    the launch, as BGMV's). ``split_k``: at most this many stretches of ``in`` (default: enough
    for about ``TARGET_PROGRAMS`` programs when the tiles are fewer: decode steps, short
    prefills); fewer when the chunks do not divide evenly."""
    num_tokens, in_features = x.shape
    num_chunks = triton.cdiv(in_features, BLOCK_K)
    if split_k is None:
        grid_tiles = max(plan.grid_tiles(num_tokens), 1)
        split_k = min(num_chunks, MAX_SPLIT_K, triton.cdiv(TARGET_PROGRAMS, grid_tiles))
    split_k = triton.cdiv(num_chunks, triton.cdiv(num_chunks, split_k))
    num_cols = lora_a.shape[0] // num_slots
    return torch.empty(split_k, num_tokens, num_cols, dtype=torch.float32, device=x.device)


def sgmv_shrink(
    h: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, plan: SegmentPlan, num_slots: int, rank: int
) -> None:
    """h (``sgmv_partials``) = each tile's split-K partials of x A^T, scattered in token order."""
    split_k, num_tokens, num_cols = h.shape
    in_features = x.shape[1]
    num_slices = num_cols // rank
    assert lora_a.shape == (num_cols * num_slots, in_features) and num_cols == num_slices * rank
    # Rows past the plan's tokens (padding) run without adapter.
    assert 1 <= num_slices <= 3 and plan.num_tokens <= num_tokens == x.shape[0]
    assert x.stride(1) == 1 and lora_a.stride(1) == 1
    grid_tiles = plan.grid_tiles(num_tokens)
    if grid_tiles == 0:
        return
    chunks_per_split = triton.cdiv(triton.cdiv(in_features, BLOCK_K), split_k)
    _sgmv_shrink_kernel[(grid_tiles, split_k)](
        h, x, lora_a, *_tiles(plan), in_features, chunks_per_split * BLOCK_K, num_slots,
        x.stride(0), lora_a.stride(0), h.stride(0), h.stride(1),
        NUM_COLS=num_cols, BLOCK_N=max(16, triton.next_power_of_2(num_cols)), BLOCK_K=BLOCK_K,
        **_common(plan, rank, split_k, lora_a.dtype), **pdl_options(x.device),
    )  # fmt: skip


def sgmv_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: torch.Tensor,
    plan: SegmentPlan,
    num_slots: int,
    rank: int,
    slice_starts: tuple[int, int],
) -> None:
    """y += each tile's h (``sgmv_shrink``'s) times its slot's B^T, in place."""
    split_k, num_tokens, num_cols, out_features = expand_shapes(y, h, lora_b, num_slots)
    grid_tiles = plan.grid_tiles(num_tokens)
    if grid_tiles == 0:
        return
    _sgmv_expand_kernel[(grid_tiles, triton.cdiv(out_features, EXPAND_BLOCK_O))](
        y, h, lora_b, *_tiles(plan), out_features, num_slots, slice_starts[0], slice_starts[1], split_k,
        y.stride(0), h.stride(0), h.stride(1), lora_b.stride(0),
        NUM_SLICES=num_cols // rank, MAX_SPLIT_K=MAX_SPLIT_K,
        BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_O=EXPAND_BLOCK_O,
        **_common(plan, rank, split_k, lora_b.dtype), **pdl_options(y.device),
    )  # fmt: skip


def _tiles(plan: SegmentPlan) -> tuple[torch.Tensor, ...]:
    return plan.tile_slot, plan.tile_m0, plan.sorted_tokens, plan.seg_start, plan.seg_len


def _common(plan: SegmentPlan, rank: int, split_k: int, dtype: torch.dtype) -> dict[str, int | bool | str]:
    """The constexprs both kernels share."""
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return {"RANK": rank, "BLOCK_M": plan.block_m, "PRECISION": precision, "SPLIT": split_k > 1}


def warm_up(
    lora_a: torch.Tensor, lora_b: torch.Tensor, num_slots: int, rank: int, slice_starts: tuple[int, int]
) -> None:
    """Compile every variant of both kernels a step can launch on this projection: one launch of
    one token for each tile height, and at the small height with K split too (a decode step, a
    short prefill), on the projection's own slot buffers (whose shapes and strides are among what
    Triton specialises on) and scratch rows of x and y. Without it, each variant compiles (about
    a second) inside the first step that needs it."""
    x = torch.zeros(1, lora_a.shape[1], dtype=lora_a.dtype, device=lora_a.device)
    y = torch.zeros(1, lora_b.shape[0], dtype=lora_a.dtype, device=lora_a.device)
    for block_m in BLOCK_MS:
        plan = plan_segments(np.zeros(1, dtype=np.int64), num_slots, lora_a.device, block_m)
        # A plan of 64-token tiles has enough of them not to split (``_block_m``).
        for split_k in (1, 2) if block_m == min(BLOCK_MS) else (1,):
            h = sgmv_partials(x, lora_a, plan, num_slots, split_k)
            sgmv_shrink(h, x, lora_a, plan, num_slots, rank)
            sgmv_expand(y, h, lora_b, plan, num_slots, rank, slice_starts)
