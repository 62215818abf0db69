"""The causal depthwise conv1d in front of a linear-attention layer's recurrence (Gated DeltaNet,
Mamba-2), SiLU after it, reading and writing each sequence's rolling window in place at its row of
the state cache (layers/linear_attention/conv1d.py holds the torch references)::

    out[t, c] = silu(bias[c] + sum_{j < K} weight[c, j] in[t - K + 1 + j, c])

where ``in`` is the sequence's inputs after its window ``conv_state[slot, c, :]`` (its last
``K - 1`` inputs, oldest first; zeros where the sequence starts). ``has_state`` [num_seqs] is
False for a sequence that starts here: its window is zeros whatever its row holds, which the
decode selects and the prefill does not read (never a product: a previous owner may have left NaN
there). Slots index rows of ``conv_state`` ``[num_rows, C, K - 1]`` (-1: the last row, the
scratch row of a CUDA graph's padding).

A column map ``cols`` (int32 [C], or None for the identity) lets conv channel ``c`` read input
column ``cols[c]`` of ``x``: Qwen3-Next's fused projection writes its outputs grouped by key head
(``[q | k | v | z]`` per head) while the conv's channels are ``[q (all heads) | k | v]``, so the
kernels read the projection's output where it lies rather than after a ``torch.cat`` copy.

``causal_conv1d_update`` (decode: one token per sequence). Grid ``(batch, cdiv(C, BLOCK_C))``; a
program owns ``BLOCK_C`` channels of one sequence: it reads the window, adds the token, writes the
window shifted by one. Bytes per sequence ~ C (2 (K - 1) + 2) element_size: memory bound.

``causal_conv1d_varlen`` (prefill: every chunk of a step in one launch). The chunks lie end to end
in ``x`` [num_tokens, X], sequence ``i`` at rows ``query_start_loc[i] .. query_start_loc[i + 1]``.
A program owns ``BLOCK_T`` tokens of one sequence and ``BLOCK_C`` channels of one output split. Its
``K`` taps are ``K`` shifted ``[BLOCK_T, BLOCK_C]`` tiles of the same ``BLOCK_T + K - 1`` rows of
x (coalesced along channels; the repeats hit L1), rows before the chunk masked to zero; a
sequence's first block then adds the window's entries, each loaded once as a ``[BLOCK_C]`` vector
and added to the rows whose taps reach back into it. Bytes ~ num_tokens C 2 element_size (each
input read once from DRAM, each output written once) plus num_seqs C 2 (K - 1) element_size for
the windows: memory bound. Without a column map the tiles load and store as 16-byte vectors when
x's row stride and the split boundaries are multiples of 16 elements; so do they through a map
that is consecutive over whole channel blocks (``cols_run``: Qwen3-Next's, in runs of 128), one
load of the map per block; through any other map the loads are per element, a gather, which on an
H200 made the prefill conv ~15x slower than its bytes (2.3 ms a layer at 16k tokens).

Grid ``(num_tokens // BLOCK_T + num_seqs, sum_j cdiv(splits[j], BLOCK_C))``. Sequence ``i``'s
token blocks are programs ``B_i .. B_i + cdiv(len_i, BLOCK_T) - 1`` of the first axis, ``B_i =
query_start_loc[i] // BLOCK_T + i``: ``B`` increases by at least ``cdiv(len_i, BLOCK_T)`` from
one sequence to the next, so the ranges are disjoint and at most one program per sequence finds
no tokens and returns. A program finds its sequence by counting the ``B_i`` at or below its index
(one vectorised pass over ``query_start_loc``, no host sync). The direct grid ``(num_seqs,
cdiv(max_query_len, BLOCK_T), ...)`` would launch a program per longest-chunk block for every
sequence: with one 8k-token chunk beside 255 short ones, 2M programs, which an H200 takes ~1.3 ms
to retire even when they return at once (~0.6 ns each), against ~0.1 ms of traffic.

The second axis walks the output splits' channel blocks split by split, so a program's channels
lie in one split and its stores are one contiguous run per row of that split's tensor.

No race on the windows: ``BLOCK_T >= K - 1``, so only a sequence's first token block has taps
before the chunk; it is the one program (per channel block) that reads the old window, and it
writes the new one (the last ``K - 1`` inputs of window + chunk, from ``x`` and, for a chunk
shorter than ``K - 1``, the old window's tail) after a barrier that orders all of its window loads
before any of those stores. No other program touches the row (the step's sequences have distinct
slots). The design follows the shape of mamba's causal-conv1d and vLLM's Triton port
(``causal_conv1d_fn``), with a packed grid in place of their host-built per-program metadata.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel


@triton.jit
def _silu(acc):
    return acc / (1.0 + tl.exp(-acc))


@triton.jit
def _weight(weight_ptr, channels, c_mask, j, KERNEL: tl.constexpr):
    """Tap j's weights of the channels, float32."""
    return tl.load(weight_ptr + channels * KERNEL + j, mask=c_mask, other=0.0).to(tl.float32)


@triton.jit
def _columns(cols_ptr, first_channel, channels, mask, BLOCK_C: tl.constexpr, COLS: tl.constexpr):
    """The input columns of a block of channels starting at ``first_channel``. COLS: 0, no map
    (the channels themselves); 1, a gather through the map; 2, the map is consecutive over the
    block and starts it at a multiple of 16 (``column_run`` in layers/linear_attention/mixer.py):
    one load, then a contiguous range that loads and stores as 16-byte vectors."""
    if COLS == 2:
        first = tl.multiple_of(tl.load(cols_ptr + first_channel), 16)
        return first + tl.arange(0, BLOCK_C)
    elif COLS == 1:
        return tl.load(cols_ptr + channels, mask=mask, other=0)
    else:
        return channels


@triton.jit
def _conv1d_update_kernel(
    out_ptr,
    x_ptr,
    weight_ptr,
    bias_ptr,
    state_ptr,
    slots_ptr,
    has_state_ptr,
    cols_ptr,
    num_channels,
    num_rows,
    stride_x_b,
    stride_out_b,
    stride_state_slot,
    stride_state_c,
    KERNEL: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    COLS: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    b = tl.program_id(0)
    first_channel = tl.program_id(1) * BLOCK_C
    channels = first_channel + tl.arange(0, BLOCK_C)
    mask = channels < num_channels
    columns = _columns(cols_ptr, first_channel, channels, mask, BLOCK_C, COLS)
    slot = tl.load(slots_ptr + b)
    slot = tl.where(slot < 0, slot + num_rows, slot)
    keep = tl.load(has_state_ptr + b) != 0
    state_row = state_ptr + slot * stride_state_slot + channels * stride_state_c
    x = tl.load(x_ptr + b * stride_x_b + columns, mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + channels, mask=mask, other=0.0).to(tl.float32)
    # Taps 0 .. KERNEL - 2 from the window (zeros for a fresh sequence), the last from x; the
    # window shifts left by one as it is read.
    for j in tl.static_range(KERNEL - 1):
        tap = tl.where(keep, tl.load(state_row + j, mask=mask, other=0.0).to(tl.float32), 0.0)
        acc += _weight(weight_ptr, channels, mask, j, KERNEL) * tap
        if j > 0:
            tl.store(state_row + j - 1, tap.to(state_ptr.dtype.element_ty), mask=mask)
    acc += _weight(weight_ptr, channels, mask, KERNEL - 1, KERNEL) * x
    tl.store(state_row + KERNEL - 2, x.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + b * stride_out_b + channels, _silu(acc).to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    cols: torch.Tensor | None = None,
    cols_run: int = 1,
) -> torch.Tensor:
    """x: [batch, X] (columns contiguous, any row stride); weight: [channels, kernel]; bias:
    [channels] or None; conv_state: [num_rows, channels, kernel - 1] contiguous, updated in place;
    slots: [batch] int64; has_state: [batch] bool; cols: [channels] int32, the column of x each
    channel reads (None: X == channels, channel c reads column c); cols_run: the map's
    ``column_run`` (host-known), which lets whole blocks load as vectors. Returns silu(conv)
    [batch, channels] in x's dtype."""
    batch = x.shape[0]
    channels, kernel = weight.shape
    _check_inputs(x, channels, kernel, conv_state, cols)
    weight = weight.contiguous()
    out = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    block_c = min(triton.next_power_of_2(channels), 256)
    if cols is not None and cols_run >= 128 and channels % 128 == 0:
        block_c = 128  # whole runs of the map
    grid = (batch, triton.cdiv(channels, block_c))
    _conv1d_update_kernel[grid](
        out, x, weight, weight if bias is None else bias, conv_state, slots, has_state,
        slots if cols is None else cols,
        channels, conv_state.shape[0],
        x.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1),
        KERNEL=kernel, BLOCK_C=block_c, HAS_BIAS=bias is not None,
        COLS=_cols_mode(cols, cols_run, block_c, (channels,)),
        **pdl_options(x.device),
    )  # fmt: skip
    return out


# The step's sizes vary from step to step: specialising on them (a count of 1, a multiple of 16)
# compiled the kernel again inside a timed W6 run, about 0.65 s each, four times.
@triton.jit(do_not_specialize=["num_seqs", "num_tokens"])
def _conv1d_varlen_kernel(
    out_ptr,
    x_ptr,
    weight_ptr,
    bias_ptr,
    state_ptr,
    slots_ptr,
    has_state_ptr,
    query_start_loc_ptr,
    cols_ptr,
    num_seqs,
    num_tokens,
    num_channels,
    split1,
    split2,
    num_rows,
    stride_x_t,
    stride_state_slot,
    stride_state_c,
    KERNEL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SEQ_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    COLS: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
):
    # The sequence: the last i with B_i = query_start_loc[i] // BLOCK_T + i <= this block (B_0 = 0).
    block = tl.program_id(0)
    seq = tl.zeros([], dtype=tl.int32)
    for first_seq in range(1, num_seqs, SEQ_BLOCK):
        ids = first_seq + tl.arange(0, SEQ_BLOCK)
        starts = tl.load(query_start_loc_ptr + ids, mask=ids < num_seqs, other=0)
        seq += tl.sum(((ids < num_seqs) & (starts // BLOCK_T + ids <= block)).to(tl.int32))
    start = tl.load(query_start_loc_ptr + seq)
    length = tl.load(query_start_loc_ptr + seq + 1) - start
    first_row = (block - start // BLOCK_T - seq) * BLOCK_T  # in the chunk
    if first_row >= length:
        return

    # The channels: the second axis walks split 0's blocks, then split 1's, then split 2's.
    c_block = tl.program_id(1)
    blocks0 = tl.cdiv(split1, BLOCK_C)
    blocks01 = blocks0 + tl.cdiv(split2 - split1, BLOCK_C)
    # The splits' bounds are multiples of SPLIT_ALIGN (the wrapper checks): said so, the compiler
    # can keep the tiles' loads and stores as 16-byte vectors.
    split_first = tl.multiple_of(
        tl.where(c_block < blocks0, 0, tl.where(c_block < blocks01, split1, split2)), SPLIT_ALIGN
    )
    split_end = tl.multiple_of(
        tl.where(c_block < blocks0, split1, tl.where(c_block < blocks01, split2, num_channels)), SPLIT_ALIGN
    )
    c_block -= tl.where(c_block < blocks0, 0, tl.where(c_block < blocks01, blocks0, blocks01))
    first_channel = split_first + c_block * BLOCK_C
    channels = first_channel + tl.arange(0, BLOCK_C)
    c_mask = channels < split_end
    columns = _columns(cols_ptr, first_channel, channels, c_mask, BLOCK_C, COLS)

    slot = tl.load(slots_ptr + seq)
    slot = tl.where(slot < 0, slot + num_rows, slot)
    keep = tl.load(has_state_ptr + seq) != 0  # else a fresh sequence: its row is not read
    state_row = state_ptr + slot * stride_state_slot + channels * stride_state_c
    x_rows = x_ptr + start.to(tl.int64) * stride_x_t + columns[None, :]

    rows = first_row + tl.arange(0, BLOCK_T)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + channels, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(KERNEL):
        pos = rows - (KERNEL - 1) + j  # the tap's input row in the chunk (< 0: in the window)
        tap = tl.load(
            x_rows + pos.to(tl.int64)[:, None] * stride_x_t,
            mask=((pos >= 0) & (pos < length))[:, None] & c_mask[None, :],
            other=0.0,
        )
        acc += _weight(weight_ptr, channels, c_mask, j, KERNEL)[None, :] * tap.to(tl.float32)
    if (first_row == 0) & keep:
        # Only the first block has taps before the chunk: window entry e is tap j of row e - j.
        # Each entry is loaded as one vector (not as shifted tiles, whose layout, contiguous
        # along the window, would cost the x tiles a trip through shared memory to match).
        for e in tl.static_range(KERNEL - 1):
            entry = tl.load(state_row + e, mask=c_mask, other=0.0).to(tl.float32)
            for j in tl.static_range(e + 1):
                term = _weight(weight_ptr, channels, c_mask, j, KERNEL) * entry
                acc += tl.where((rows == e - j)[:, None], term[None, :], 0.0)
    out = out_ptr + split_first.to(tl.int64) * num_tokens + channels[None, :] - split_first
    out += (start + rows).to(tl.int64)[:, None] * (split_end - split_first)
    tl.store(out, _silu(acc).to(out_ptr.dtype.element_ty), mask=(rows < length)[:, None] & c_mask[None, :])

    if first_row == 0:
        # The new window: entries length .. length + K - 2 of [old window | chunk].
        w = tl.arange(0, BLOCK_W)
        src = length + w
        w_mask = (w < KERNEL - 1)[:, None] & c_mask[None, :]
        readable = tl.where(keep, KERNEL - 1, 0)
        old = tl.load(state_row[None, :] + src[:, None], mask=w_mask & (src < readable)[:, None], other=0.0)
        new = tl.load(
            x_rows + (src - (KERNEL - 1)).to(tl.int64)[:, None] * stride_x_t,
            mask=w_mask & (src >= KERNEL - 1)[:, None],
            other=0.0,
        )
        new = tl.where((src < KERNEL - 1)[:, None], old.to(tl.float32), new.to(tl.float32))
        tl.debug_barrier()  # every thread's reads of the old window come before these writes
        tl.store(state_row[None, :] + w[:, None], new.to(state_ptr.dtype.element_ty), mask=w_mask)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    splits: tuple[int, ...],
    cols: torch.Tensor | None = None,
    cols_run: int = 1,
) -> tuple[torch.Tensor, ...]:
    """Every prefill chunk of a step. x: [num_tokens, X] (columns contiguous, any row stride), the
    chunks of num_seqs sequences end to end; weight: [channels, kernel]; bias: [channels] or None;
    conv_state: [num_rows, channels, kernel - 1] contiguous, each sequence's row updated in place
    to the last kernel - 1 inputs of its window and chunk; slots: [num_seqs] int64 (negative:
    from the end); has_state: [num_seqs] bool, False where the sequence starts (its row is not
    read); query_start_loc: [num_seqs + 1] int32, from 0 to num_tokens; max_query_len: the longest
    chunk (sizes the token tile); splits: one to three channel counts summing to channels; cols,
    cols_run: as ``causal_conv1d_update``'s. Returns silu(conv) as len(splits) contiguous tensors
    [num_tokens, splits[j]] in x's dtype (views of one allocation)."""
    num_tokens, num_seqs = x.shape[0], slots.shape[0]
    channels, kernel = weight.shape
    _check_inputs(x, channels, kernel, conv_state, cols)
    assert 1 <= len(splits) <= 3 and min(splits) > 0 and sum(splits) == channels, splits
    assert query_start_loc.shape == (num_seqs + 1,) and query_start_loc.dtype == torch.int32
    ends = list(itertools.accumulate(splits))
    flat = torch.empty(num_tokens * channels, dtype=x.dtype, device=x.device)
    outs = tuple(
        flat[num_tokens * (end - width) : num_tokens * end].view(num_tokens, width)
        for width, end in zip(splits, ends)
    )
    if num_seqs == 0:
        return outs
    # A step of short chunks (new short prompts) runs short tiles rather than mostly masked ones.
    block_t = min(max(triton.next_power_of_2(max_query_len), 16), 64)
    assert kernel - 1 <= block_t, "a token block must cover the window for the race-free write"
    block_c = 128
    split1, split2 = (*ends[:-1], channels, channels)[:2]
    grid = (num_tokens // block_t + num_seqs, sum(triton.cdiv(width, block_c) for width in splits))
    _conv1d_varlen_kernel[grid](
        flat, x, weight.contiguous(), weight if bias is None else bias, conv_state, slots, has_state,
        query_start_loc, slots if cols is None else cols,
        num_seqs, num_tokens, channels, split1, split2, conv_state.shape[0],
        x.stride(0), conv_state.stride(0), conv_state.stride(1),
        KERNEL=kernel, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_W=triton.next_power_of_2(kernel - 1),
        SEQ_BLOCK=256, HAS_BIAS=bias is not None, COLS=_cols_mode(cols, cols_run, block_c, ends),
        SPLIT_ALIGN=16 if all(end % 16 == 0 for end in ends) else 1,
    )  # fmt: skip
    return outs


def _check_inputs(
    x: torch.Tensor, channels: int, kernel: int, conv_state: torch.Tensor, cols: torch.Tensor | None
) -> None:
    assert kernel >= 2 and x.stride(1) == 1 and conv_state.is_contiguous(), "unexpected layout"
    assert conv_state.shape[1:] == (channels, kernel - 1), conv_state.shape
    if cols is None:
        assert x.shape[1] == channels, (x.shape, channels)
    else:
        assert cols.shape == (channels,) and cols.dtype == torch.int32, (cols.shape, cols.dtype)


def _cols_mode(
    cols: torch.Tensor | None, cols_run: int, block_c: int, bounds: list[int] | tuple[int, ...]
) -> int:
    """_columns' COLS: 0 without a map; 2 where every channel block is one run of the map (blocks
    start at multiples of block_c within splits whose bounds are multiples of it); else 1."""
    if cols is None:
        return 0
    whole = cols_run >= block_c and block_c % 16 == 0 and all(bound % block_c == 0 for bound in bounds)
    return 2 if whole else 1
