"""A step's recurrent-state rows moved between the state cache and a batch's dense tensor, for a
chunked prefill that takes its sequences' initial states and returns their final states as
dense ``[num_seqs, ...]`` tensors (flash-linear-attention's ``chunk_gated_delta_rule``: it reads
``initial_state`` in any dtype, converting on load, and returns ``final_state`` in float32, both
contiguous, the layout of one cache row).

``gather_state_rows``: ``out[i] = state[slots[i]]`` where ``has_state[i]``, else zeros, in one
pass. The torch expression, ``torch.where(has_state, state[slots], 0)``, gathers every row into
a temporary first and then selects, reading and writing each row twice; here a fresh sequence's
row is not even read (its slot may hold a previous owner's state, or NaN).

``scatter_state_rows``: ``state[slots[i]] = rows[i]``, rounded to the cache's dtype by the store.
The torch expression, ``state[slots] = rows.to(state.dtype)``, casts into a temporary first.

Both: grid ``(num_seqs, cdiv(row_size, BLOCK))``; a program copies ``BLOCK`` consecutive elements
of one sequence's row (``BLOCK`` 4096 at 4 warps: 32 elements a thread, 16-byte vectors in any of
the cache's dtypes). Layouts: each row contiguous (``row_size`` elements), rows any stride apart
(``stride_*``); slots [num_seqs] int32/int64 (negative counts from the end, as torch indexing
does: -1 is the scratch row), has_state [num_seqs] bool. Memory bound, no FLOPs: per sequence the
gather reads a row (none for a fresh sequence) and writes one, ``2 row_size element_size`` bytes;
the scatter reads a float32 row and writes one in the cache's dtype. At Gated DeltaNet's 32 heads
of 128 x 128 in bf16, 1 MiB a row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def cache_row(slots_ptr, seq, num_rows, stride_row):
    """The offset of sequence ``seq``'s row in the cache (its slot; a negative one from the end,
    -1 the scratch row of a CUDA graph's padding). The decode kernels' too (linear_attention.py,
    ssd.py)."""
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    return tl.where(slot < 0, slot + num_rows, slot) * stride_row


@triton.jit
def _gather_state_rows_kernel(
    out_ptr,
    state_ptr,
    slots_ptr,
    has_state_ptr,
    num_rows,
    row_size,
    stride_out,
    stride_state,
    BLOCK: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_size
    # A fresh sequence's row is masked off whole: zeros, whatever the row holds.
    read = offs < tl.where(tl.load(has_state_ptr + seq) != 0, row_size, 0)
    row = state_ptr + cache_row(slots_ptr, seq, num_rows, stride_state)
    values = tl.load(row + offs, mask=read, other=0.0)
    tl.store(out_ptr + seq * stride_out + offs, values, mask=mask)


@triton.jit
def _scatter_state_rows_kernel(
    state_ptr,
    rows_ptr,
    slots_ptr,
    num_rows,
    row_size,
    stride_state,
    stride_rows,
    BLOCK: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_size
    values = tl.load(rows_ptr + seq * stride_rows + offs, mask=mask)
    row = state_ptr + cache_row(slots_ptr, seq, num_rows, stride_state)
    tl.store(row + offs, values.to(state_ptr.dtype.element_ty), mask=mask)


def _row_size(state: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> int:
    """Elements per row, once the layouts are checked (see the module docstring); rows not empty."""
    assert state.shape[1:] == rows.shape[1:] and rows.shape[0] == slots.shape[0], (state.shape, rows.shape)
    assert state[0].is_contiguous() and rows[0].is_contiguous(), "each row must be contiguous"
    assert slots.dim() == 1 and slots.is_contiguous() and not slots.dtype.is_floating_point, slots
    return state[0].numel()


def gather_state_rows(state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
    """state: [num_rows, ...] (the cache); slots: [num_seqs]; has_state: [num_seqs] bool. Returns
    [num_seqs, ...] contiguous, in the state's dtype: row i is ``state[slots[i]]`` where
    ``has_state[i]``, else zeros."""
    out = torch.empty(slots.shape[0], *state.shape[1:], dtype=state.dtype, device=state.device)
    if out.numel() == 0:
        return out
    row_size = _row_size(state, out, slots)
    assert has_state.shape == slots.shape and has_state.dtype == torch.bool, has_state
    _gather_state_rows_kernel[(out.shape[0], triton.cdiv(row_size, BLOCK))](
        out, state, slots, has_state, state.shape[0], row_size, out.stride(0), state.stride(0), BLOCK=BLOCK
    )
    return out


def scatter_state_rows(state: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """state[slots[i]] = rows[i], rounded to state's dtype. state: [num_rows, ...] (the cache),
    updated in place; slots: [num_seqs], distinct rows; rows: [num_seqs, ...] any dtype."""
    if rows.numel() == 0:
        return
    row_size = _row_size(state, rows, slots)
    _scatter_state_rows_kernel[(rows.shape[0], triton.cdiv(row_size, BLOCK))](
        state, rows, slots, state.shape[0], row_size, state.stride(0), rows.stride(0), BLOCK=BLOCK
    )
