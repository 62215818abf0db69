"""The sampler's last pass: each row's token (greedy argmax or the exponential race) and the model's
logprob of it, from one read of the logits, split across the row.

For each row ``r``::

    score[r, v] = x[r, v]                                        greedy row
    score[r, v] = x[r, v] * inv_temperature[r] - log(q[r, v])    sampled row, q ~ Exp(1)
    token[r]    = argmax_v score[r, v]        (the first on ties, as torch.argmax)
    logprob[r]  = raw[r, token[r]] - logsumexp_v raw[r, v]

``argmax(x / T - log q)`` is ``argmax(softmax(x / T) / q)``, the exponential race (Gumbel-max), with
no softmax: the row needs no normalisation to be sampled. ``x`` is the logits after penalties and
bans (and, for rows truncated by top-k/top-p/min-p, already scaled and truncated, with
``inv_temperature`` 1); ``raw`` the model's logits, whose logprobs are reported. With a grammar
bitmask (structured outputs), a token whose bit is 0 reads as -inf in both ``raw`` and ``x``, as
if ``apply_token_bitmask`` had run first, without its launch (on a step bound by the host, the
launch costs more than the kernel).

Why a kernel: torch reduces a row (``argmax``, ``log_softmax``) in one thread block, which leaves
the GPU idle for one or a few rows of a large vocabulary (27 and 29 us for one row of Llama-3's
128,256 tokens on an H200); and ``log_softmax`` writes a ``[rows, vocab]`` float32 tensor that only
one element per row is read from.

Grid: ``_partials_kernel`` runs ``(num_rows, cdiv(vocab, CHUNK))`` programs; program ``(r, c)`` reads
``CHUNK`` elements of row ``r`` of ``raw``, ``x`` (when it is not ``raw``) and ``q`` (when sampled),
and ``CHUNK / 32`` words of the bitmask (when given), and writes four float32/int32 partials: its
best score and where it is, the max of ``raw`` and the sum of ``exp(raw - max)``.
``_merge_kernel`` runs one program per row over that row's partials (at most a few hundred) and
writes the token (int64), its logprob and the row's logsumexp (float32).

Layouts: ``raw``, ``x``, ``q``: ``[num_rows, vocab]`` float32, contiguous rows (any row stride);
``bitmask``: ``[num_rows, ceil(vocab / 32)]`` int32, bit ``t % 32`` of word ``t // 32`` for token ``t``.
Bound: memory, ``(1 + (x is not raw) + sampled) * 4`` bytes per element read, nothing of the
vocabulary's size written; a few FLOPs per element (one exp, one log per sampled element).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _partials_kernel(
    raw_ptr,
    x_ptr,
    q_ptr,
    inv_temperature_ptr,
    greedy_ptr,
    bitmask_ptr,
    part_score_ptr,
    part_index_ptr,
    part_max_ptr,
    part_sum_ptr,
    vocab_size,
    num_chunks,
    stride_raw,
    stride_x,
    stride_q,
    stride_bitmask,
    CHUNK: tl.constexpr,
    X_IS_RAW: tl.constexpr,
    HAS_Q: tl.constexpr,
    HAS_BITMASK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    in_vocab = cols < vocab_size
    if HAS_BITMASK:
        words = tl.load(bitmask_ptr + row * stride_bitmask + cols // 32, mask=in_vocab, other=0)
        in_vocab = in_vocab & (((words >> (cols % 32)) & 1) != 0)
    raw = tl.load(raw_ptr + row * stride_raw + cols, mask=in_vocab, other=float("-inf"))
    # The chunk's share of logsumexp(raw): its max and sum(exp(raw - max)); a chunk of -inf
    # (masked, or banned everywhere) adds 0 with a finite stand-in for its max.
    raw_max = tl.max(raw, axis=0)
    shift = tl.where(raw_max == float("-inf"), 0.0, raw_max)
    raw_sum = tl.sum(tl.exp(raw - shift), axis=0)
    if X_IS_RAW:
        score = raw
    else:
        score = tl.load(x_ptr + row * stride_x + cols, mask=in_vocab, other=float("-inf"))
    if HAS_Q:  # noqa: SIM102 (a constexpr, then a runtime test: Triton folds the first alone)
        if tl.load(greedy_ptr + row) == 0:
            # Exp(1) draws can round to 0: log 0 against a banned token's -inf would be NaN.
            q = tl.maximum(tl.load(q_ptr + row * stride_q + cols, mask=in_vocab, other=1.0), 1.1754944e-38)
            score = score * tl.load(inv_temperature_ptr + row) - tl.log(q)
    best, index = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    out = row * num_chunks + chunk
    tl.store(part_score_ptr + out, best)
    tl.store(part_index_ptr + out, chunk * CHUNK + index)
    tl.store(part_max_ptr + out, raw_max)
    tl.store(part_sum_ptr + out, raw_sum)


@triton.jit
def _merge_kernel(
    raw_ptr,
    part_score_ptr,
    part_index_ptr,
    part_max_ptr,
    part_sum_ptr,
    token_ids_ptr,
    logprobs_ptr,
    logsumexp_ptr,
    num_chunks,
    stride_raw,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    valid = cols < num_chunks
    parts = row * num_chunks + cols
    scores = tl.load(part_score_ptr + parts, mask=valid, other=float("-inf"))
    indices = tl.load(part_index_ptr + parts, mask=valid, other=0)
    # The leftmost chunk holding the row's best score: the first maximum, as torch.argmax.
    _, best_chunk = tl.max(scores, axis=0, return_indices=True, return_indices_tie_break_left=True)
    token = tl.sum(tl.where(cols == best_chunk, indices, 0), axis=0)
    maxes = tl.load(part_max_ptr + parts, mask=valid, other=float("-inf"))
    sums = tl.load(part_sum_ptr + parts, mask=valid, other=0.0)
    row_max = tl.max(maxes, axis=0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    maxes = tl.where(maxes == float("-inf"), shift, maxes)  # their sums are 0
    logsumexp = shift + tl.log(tl.sum(sums * tl.exp(maxes - shift), axis=0))
    chosen = tl.load(raw_ptr + row * stride_raw + token)
    tl.store(token_ids_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, chosen - logsumexp)
    tl.store(logsumexp_ptr + row, logsumexp)


def _chunk_size(num_rows: int) -> int:
    # A few rows split into small chunks so the programs cover the GPU; a batch already does.
    # (warm_up compiles both sizes.)
    return 1024 if num_rows < 32 else 4096


# ``invariant=True``: one chunk size for every batch, so a row's partials and their merge are the
# same sums whatever the number of rows, and no FMA contraction, so the variants a batch's mix
# of rows compiles (sampled or greedy, penalised or not, a bitmask or not) compute ``raw``'s
# maximum and sum alike: a row's logsumexp is the same bits in every batch and in ``logsumexp``.
INVARIANT_CHUNK = 1024


def sample_tokens(
    raw: torch.Tensor,
    x: torch.Tensor,
    q: torch.Tensor | None = None,
    inv_temperature: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
    invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token and the logprob of it under ``raw`` (see the module docstring).

    Args:
        raw: [num_rows, vocab] float32, the model's logits.
        x: [num_rows, vocab] float32, what is sampled from (``raw`` itself when nothing changed it).
        q: [num_rows, vocab] float32 Exp(1) noise, or None when every row is greedy.
        inv_temperature: [num_rows] float32, with ``q``.
        greedy: [num_rows] bool, with ``q``: rows that take the argmax of ``x``.
        bitmask: [num_rows, ceil(vocab / 32)] int32 on the logits' device or in pinned host
            memory (read in place, over the bus), or None: the tokens each row may take (its other
            tokens read as -inf in ``raw`` and ``x``).
        invariant: a row's results independent of the other rows (``INVARIANT_CHUNK``), its
            logprob ``raw[token] - logsumexp(raw, invariant=True)`` to the bit.
    Returns:
        token ids [num_rows] int64 and their logprobs [num_rows] float32.
    """
    token_ids, logprobs, _ = _launch(raw, x, q, inv_temperature, greedy, bitmask, invariant)
    return token_ids, logprobs


def logsumexp(raw: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """Each row's logsumexp, [num_rows] float32, from the same two kernels as ``sample_tokens``
    (a greedy pass whose tokens go unused): with ``invariant``, the bits ``sample_tokens``
    subtracts from the chosen logit, so ``raw - logsumexp(raw)[:, None]`` are the logprobs it
    reports."""
    return _launch(raw, raw, None, None, None, None, invariant)[2]


def _launch(
    raw: torch.Tensor,
    x: torch.Tensor,
    q: torch.Tensor | None,
    inv_temperature: torch.Tensor | None,
    greedy: torch.Tensor | None,
    bitmask: torch.Tensor | None,
    invariant: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_rows, vocab_size = raw.shape
    assert raw.dtype == x.dtype == torch.float32 and raw.stride(1) == x.stride(1) == 1
    has_q = q is not None
    if has_q:
        assert (
            q.shape == raw.shape and q.stride(1) == 1 and inv_temperature is not None and greedy is not None
        )
    has_bitmask = bitmask is not None
    if has_bitmask:
        assert bitmask.dtype == torch.int32 and bitmask.shape == (num_rows, triton.cdiv(vocab_size, 32))
        assert bitmask.stride(1) == 1
    chunk = INVARIANT_CHUNK if invariant else _chunk_size(num_rows)
    num_chunks = triton.cdiv(vocab_size, chunk)
    # One allocation each, so every pointer is 16-byte aligned whatever num_rows * num_chunks is:
    # slices of one buffer would be aligned or not by the batch's row count, and Triton compiles
    # a variant per alignment (mid-run, seconds into serving).
    part_score, part_max, part_sum = (
        torch.empty((num_rows, num_chunks), dtype=torch.float32, device=raw.device) for _ in range(3)
    )
    part_index = torch.empty((num_rows, num_chunks), dtype=torch.int32, device=raw.device)
    # Unused pointers (no noise) take raw's: the kernel never reads them.
    _partials_kernel[(num_rows, num_chunks)](
        raw,
        x,
        q if has_q else raw,
        inv_temperature if has_q else raw,
        greedy if has_q else raw,
        bitmask if has_bitmask else raw,
        part_score,
        part_index,
        part_max,
        part_sum,
        vocab_size,
        num_chunks,
        raw.stride(0),
        x.stride(0),
        q.stride(0) if has_q else 0,
        bitmask.stride(0) if has_bitmask else 0,
        CHUNK=chunk,
        X_IS_RAW=x is raw,
        HAS_Q=has_q,
        HAS_BITMASK=has_bitmask,
        enable_fp_fusion=not invariant,
    )
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=raw.device)
    logprobs, row_logsumexp = (
        torch.empty(num_rows, dtype=torch.float32, device=raw.device) for _ in range(2)
    )
    _merge_kernel[(num_rows,)](
        raw,
        part_score,
        part_index,
        part_max,
        part_sum,
        token_ids,
        logprobs,
        row_logsumexp,
        num_chunks,
        raw.stride(0),
        BLOCK_C=triton.next_power_of_2(num_chunks),
        enable_fp_fusion=not invariant,
    )
    return token_ids, logprobs, row_logsumexp


def warm_up(vocab_size: int, device: torch.device, invariant: bool = False) -> None:
    """Compile every variant a step can launch (chunk sizes, greedy or sampled, ``x`` the logits
    or not, with the grammar bitmask or without, and the bitmask's own pass) before the first
    request, so that none compiles inside a step (about a second each on a cold cache)."""
    for num_rows in (1,) if invariant else (1, 32):
        raw = torch.zeros((num_rows, vocab_size), dtype=torch.float32, device=device)
        noise = torch.ones_like(raw)
        inv_temperature = torch.ones(num_rows, device=device)
        greedy = torch.zeros(num_rows, dtype=torch.bool, device=device)
        bitmask = torch.full((num_rows, triton.cdiv(vocab_size, 32)), -1, device=device, dtype=torch.int32)
        for x in (raw, raw.clone()):
            for words in (None, bitmask):
                sample_tokens(raw, x, bitmask=words, invariant=invariant)
                sample_tokens(raw, x, noise, inv_temperature, greedy, bitmask=words, invariant=invariant)
        # Structured outputs' mask on its own, before a truncation (top-k/top-p/min-p).
        apply_token_bitmask(raw, bitmask)


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr, bitmask_ptr, vocab_size, stride_logits, stride_bitmask, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab_size
    words = tl.load(bitmask_ptr + row * stride_bitmask + cols // 32, mask=in_vocab, other=-1)
    banned = ((words >> (cols % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_logits + cols, float("-inf"), mask=in_vocab & banned)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[r, t]`` to -inf where bit ``t % 32`` of ``bitmask[r, t // 32]`` is 0, in place.

    Grid ``(num_rows, cdiv(vocab, 1024))``: each program reads 32 int32 words and writes the
    banned logits of its 1,024 tokens. One launch where the elementwise unpacking in torch takes
    eight, with a ``[rows, words, 32]`` intermediate. logits: [rows, vocab] float32, contiguous
    rows; bitmask: [rows, ceil(vocab / 32)] int32 on the logits' device.
    """
    num_rows, vocab_size = logits.shape
    block = 1024
    _apply_bitmask_kernel[(num_rows, triton.cdiv(vocab_size, block))](
        logits, bitmask, vocab_size, logits.stride(0), bitmask.stride(0), BLOCK=block
    )
