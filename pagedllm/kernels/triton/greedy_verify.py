"""Verification of greedy requests' drafts in one launch (speculative decoding).

When every request of a verification is greedy, rejection sampling (sample/rejection_sampler.py)
is a prefix match: a request accepts its drafts up to the first that differs from the target's
argmax at its position, then emits the argmax there. The torch form of that takes about twenty
launches of tiny kernels (row indices, gathers, a cumulative product, a scatter); a verify step
is bound by the host's launches, so this kernel does it in one.

Grid: ``(num_reqs,)``; program ``r`` handles request ``r``'s ``k_r + 1`` rows of the target's
argmax (the rows ``first_row[r] .. first_row[r] + k_r``), with ``BLOCK >= K + 1`` lanes::

    row_index[r, j]   = first_row[r] + min(j, k_r)
    accept[j]         = j < k_r and (draft[r, j] == argmax[row_index[r, j]]       greedy
                                     or draw[r, j] < rate)                        synthetic
    num_accepted[r]   = first j with accept[j] false
    output[r, j]      = draft[r, j] for j < a, argmax[row_index[r, a]] at j = a, -1 after

Layouts: ``drafts`` [num_reqs, K] int64 (-1 past a request's drafts), ``draws`` [num_reqs, K]
float32, ``meta`` [2, num_reqs] int64 (``k_r`` then ``first_row[r]``), ``argmax`` [num_rows] int64;
outputs ``output`` and ``row_index`` [num_reqs, K + 1] int64, ``num_accepted`` [num_reqs] int64.
Bound: launch latency; it reads and writes a few dozen bytes per request.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _greedy_verify_kernel(
    drafts_ptr,
    draws_ptr,
    meta_ptr,
    argmax_ptr,
    output_ptr,
    row_index_ptr,
    num_accepted_ptr,
    num_reqs,
    rate,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    SYNTHETIC: tl.constexpr,
):
    r = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    num_drafts = tl.load(meta_ptr + r)
    first_row = tl.load(meta_ptr + num_reqs + r)
    in_row = j < K + 1
    rows = first_row + tl.minimum(j, num_drafts)
    target = tl.load(argmax_ptr + rows, mask=in_row, other=0)
    draft = tl.load(drafts_ptr + r * K + j, mask=j < K, other=-1)
    is_draft = j < num_drafts
    if SYNTHETIC:
        draw = tl.load(draws_ptr + r * K + j, mask=j < K, other=1.0)
        accept = (draw < rate) & is_draft
    else:
        accept = (draft == target) & is_draft
    # The first position that is not accepted (at most num_drafts: past it nothing is a draft).
    num_accepted = tl.min(tl.where(accept, BLOCK, j), axis=0)
    last = tl.sum(tl.where(j == num_accepted, target, 0), axis=0)
    output = tl.where(j < num_accepted, draft, tl.where(j == num_accepted, last, -1))
    tl.store(output_ptr + r * (K + 1) + j, output, mask=in_row)
    tl.store(row_index_ptr + r * (K + 1) + j, rows, mask=in_row)
    tl.store(num_accepted_ptr + r, num_accepted.to(tl.int64))


def greedy_verify(
    drafts: torch.Tensor,
    num_drafts: np.ndarray,
    target_argmax: torch.Tensor,
    synthetic_acceptance_rate: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """drafts: [num_reqs, K] int64 (device, -1 past a request's drafts); num_drafts: [num_reqs]
    (host); target_argmax: [sum(k + 1)] int64, each verify row's argmax. Returns (output token
    ids [num_reqs, K + 1], num_accepted [num_reqs], row_index [num_reqs, K + 1]), as
    ``rejection_sample`` does for greedy requests (the same draws of ``torch.rand`` when
    ``synthetic_acceptance_rate`` is given)."""
    num_reqs, max_num_drafts = drafts.shape
    device = drafts.device
    first_row = np.cumsum(num_drafts + 1) - (num_drafts + 1)
    meta = torch.from_numpy(np.stack([num_drafts, first_row]).astype(np.int64))
    if device.type == "cuda":
        meta = meta.pin_memory().to(device, non_blocking=True)
    synthetic = synthetic_acceptance_rate is not None
    draws = torch.rand((num_reqs, max_num_drafts), device=device) if synthetic else drafts
    output = torch.empty((num_reqs, max_num_drafts + 1), dtype=torch.int64, device=device)
    row_index = torch.empty_like(output)
    num_accepted = torch.empty(num_reqs, dtype=torch.int64, device=device)
    _greedy_verify_kernel[(num_reqs,)](
        drafts.contiguous(),
        draws,
        meta,
        target_argmax,
        output,
        row_index,
        num_accepted,
        num_reqs,
        synthetic_acceptance_rate or 0.0,
        K=max_num_drafts,
        BLOCK=triton.next_power_of_2(max_num_drafts + 1),
        SYNTHETIC=synthetic,
    )
    return output, num_accepted, row_index
