"""The deferred take-back of asynchronous speculation in one launch (worker/take_back.py:
``take_back_on_device``; its torch form, ``take_back_torch``, is about a dozen tiny kernels, and a
step of decodes with a verification in flight is bound by the host's launches).

A step was planned as if the step in flight accepted every draft; that step rejected some of
each request's. Every token t of the step (a sequence of its own: decodes and expanded
verifications) moves back by its request's count, ``rejected[token_index[t]]``::

    back            = rejected[token_index[t]]
    positions[t]   -= back
    seq_lens[t]    -= back
    slot_mapping[t] = block_tables[t, positions[t] // block_size] * block_size + positions[t] % block_size

Grid: ``(cdiv(num_tokens, BLOCK),)``, one token per lane. Layouts: ``rejected`` [any] int64;
``token_index`` [num_tokens] int32; ``positions`` [>= num_tokens] int64, ``seq_lens`` int32,
``slot_mapping`` int64 (updated in place); ``block_tables`` [>= num_tokens, width] int32 (row stride
any). Bytes: about 40 per token; bound by launch latency at any step size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 256


# num_tokens changes every step: specialised (== 1, % 16 == 0) it would compile new variants mid-run.
@triton.jit(do_not_specialize=["num_tokens"])
def _take_back_kernel(
    rejected_ptr,
    token_index_ptr,
    positions_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_bt,
    block_size,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = t < num_tokens
    index = tl.load(token_index_ptr + t, mask=live, other=0)
    back = tl.load(rejected_ptr + index, mask=live, other=0)
    position = tl.load(positions_ptr + t, mask=live, other=0) - back
    tl.store(positions_ptr + t, position, mask=live)
    seq_len = tl.load(seq_lens_ptr + t, mask=live, other=0)
    tl.store(seq_lens_ptr + t, seq_len - back.to(seq_len.dtype), mask=live)
    row = block_tables_ptr + t.to(tl.int64) * stride_bt
    block = tl.load(row + position // block_size, mask=live, other=0)
    tl.store(slot_mapping_ptr + t, block.to(tl.int64) * block_size + position % block_size, mask=live)


def take_back(
    rejected: torch.Tensor,
    token_index: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> None:
    """The first ``len(token_index)`` tokens of the step moved back by ``rejected``, in place (see the
    module docstring)."""
    num_tokens = token_index.shape[0]
    assert positions.dtype == slot_mapping.dtype == rejected.dtype == torch.int64
    assert block_tables.stride(1) == 1 and min(positions.shape[0], seq_lens.shape[0]) >= num_tokens
    if num_tokens == 0:
        return
    grid = (triton.cdiv(num_tokens, _BLOCK),)
    _take_back_kernel[grid](
        rejected,
        token_index,
        positions,
        seq_lens,
        block_tables,
        slot_mapping,
        num_tokens,
        block_tables.stride(0),
        block_size,
        BLOCK=_BLOCK,
    )
