"""Prompt lookup (speculative decoding's ``ngram`` method) on the device in one launch.

The rule is worker/ngram_drafter.py's (``ngram_drafts`` is its torch form, about twenty launches
of tiny kernels; an asynchronous n-gram step is bound by the host's launches): for each request,
the longest suffix of its tokens, up to ``MAX_N``, that recurs ending at an earlier position e
(the latest e among equals), if at least ``min_n`` long; the drafts are the tokens after e,
continued periodically past the newest token; no match repeats the newest token.

Grid: ``(num_reqs,)``; program ``r`` reads batch row ``rows[r]`` of the token table up to its
newest position n = ``newest[r]``, BLOCK earlier positions at a time::

    for e in the block (e < n):  len[e] = run of j = 0 .. MAX_N - 1 with tokens[e - j] == tokens[n - j]
    best = max over e of len[e] * (n + 1) + e        (longest, then latest)
    end  = best's e if its len >= min_n else n - 1;  period = n - end
    out[r, i] = tokens[end + 1 + i % period]         i < K

Layouts: ``token_ids`` [rows, max_len] int32 (row stride any); ``rows``, ``newest`` [num_reqs]
int64; ``out`` [num_reqs, K] int32. Bytes: about ``MAX_N * n * 4`` per request (the table's rows,
mostly from L1/L2 after the first shift); no FLOPs to speak of: bound by launch latency below a
few thousand tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ngram_lookup_kernel(
    tokens_ptr,
    stride,
    rows_ptr,
    newest_ptr,
    out_ptr,
    min_n,
    K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    MAX_N: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r)
    newest = tl.load(newest_ptr + r)
    base = tokens_ptr + row * stride
    span = newest + 1  # the key's radix: every e < newest < span
    best = tl.full((), -1, tl.int64)
    for start in range(0, newest, BLOCK):
        e = start + tl.arange(0, BLOCK)
        run = e < newest
        length = tl.zeros((BLOCK,), dtype=tl.int64)
        for j in tl.static_range(MAX_N):
            # Out of range: the suffix's token reads -1, the candidate's -2; they match nothing.
            suffix = tl.load(base + newest - j, mask=newest - j >= 0, other=-1)
            token = tl.load(base + e - j, mask=run & (e - j >= 0), other=-2)
            run = run & (token == suffix)
            length += run.to(tl.int64)
        key = tl.where(e < newest, length * span + e, -1)
        best = tl.maximum(best, tl.max(key, axis=0))
    best_len = tl.where(best >= 0, best // span, 0)
    end = tl.where((best >= 0) & (best_len >= min_n), best % span, newest - 1)
    period = newest - end
    i = tl.arange(0, K_BLOCK)
    drafts = tl.load(base + end + 1 + i % period, mask=i < K, other=0)
    tl.store(out_ptr + r * K + i, drafts, mask=i < K)


def ngram_lookup(
    token_ids: torch.Tensor, rows: torch.Tensor, newest: torch.Tensor, num_drafts: int, min_n: int, max_n: int
) -> torch.Tensor:
    """[len(rows), num_drafts] int32 drafts for the requests in table ``rows`` of ``token_ids``
    ([rows, max_len] int32), whose newest tokens sit at ``newest`` (module docstring)."""
    num_reqs = len(rows)
    out = torch.empty((num_reqs, num_drafts), dtype=torch.int32, device=token_ids.device)
    if num_reqs:
        _ngram_lookup_kernel[(num_reqs,)](
            token_ids,
            token_ids.stride(0),
            rows,
            newest,
            out,
            min_n,
            K=num_drafts,
            K_BLOCK=triton.next_power_of_2(num_drafts),
            MAX_N=max_n,
            BLOCK=256,
            num_warps=4,
        )
    return out
