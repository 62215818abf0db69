"""Paged prefill attention: chunks of new queries over their cached prefix and themselves.

Algorithm: FlashAttention-2's forward (Dao 2023) with K/V gathered through each sequence's block
table (``paged_tiles.attend_paged_range``). Sequence ``s`` brings ``query_len`` new tokens whose K/V
``reshape_and_cache`` has already written, so its whole context -- ``context_len = seq_len -
query_len`` cached tokens (an earlier chunk, or a prefix-cache hit) plus the chunk itself -- is read
from the paged cache. Query ``i`` sits at position ``context_len + i`` and sees keys ``<=`` it: the
causal mask is aligned to the *end* of the context. This one kernel covers plain prefill
(``context_len = 0``), chunked prefill and prefix caching.

Grid ``(cdiv(max_query_len, BLOCK_M), num_heads, num_prefills)``. A program owns ``BLOCK_M`` query
tokens of one sequence and one query head; programs whose rows start past the sequence's
``query_len`` return at once. It walks keys ``[0, kv_end)`` with ``kv_end = min(seq_len,
last row's position + 1)`` in two stages: keys before the tile's first query position are visible to
every row and need no mask; the remaining (diagonal) tiles apply the causal mask. The query-block
index is the fastest grid axis and heads of one KV group are adjacent, so programs that read the same
K/V run together and share it through L2. With a sliding window both stages start at the window's
first tile of the program's first row (keys before it are not even loaded: their blocks may be
freed) and mask every tile, since the window's lower edge moves with the row like the diagonal.

With ``PACK_GQA`` (the batch-invariant backend's launch), a program owns one KV head instead, and
its ``BLOCK_M`` rows are (token, query head) pairs, the ``NUM_QUERIES_PER_KV`` heads of the group
adjacent: row ``r`` is token ``r // G`` of head ``kv_head * G + r % G``, grid ``(cdiv(max_query_len
* G, BLOCK_M), num_kv_heads, num_prefills)``. The group's heads then share each K/V tile read, as in
``paged_decode``: a decode (one token) fills G rows of a tile rather than one. The stages' bounds
come from the program's first and last token as before; every row's arithmetic is the same.

Attention sinks (``SINKS``; StreamingLLM, Xiao et al. 2023) add one stage before those, over the
tile(s) of keys ``[0, min(attention_sinks, kv_end - sliding_window))``: the sinks the window of the
program's last row has passed. It scores them with the rows of ``sink_query`` and keeps, per row,
only the keys that row's window has passed (``<= q_pos - sliding_window``); the windowed stages
keep the complement (``> q_pos - sliding_window``), so every visible (row, key) is scored once,
with the right query, into one online softmax. Keys between the sinks and the window are not
read. A program whose rows' windows have passed no sink (sink stage bound 0) runs no extra tile
and does not load ``sink_query``.

Context parallelism (``CP_SIZE = P > 1``, with ``PARTIAL``): rank ``r``'s cache holds the keys at
global positions ``t = j * P + r`` at local index ``j``; seq_lens, query_start_loc and so every
``q_pos`` stay global (each rank sees every query of the step). The stages' bounds become local
(``paged_tiles.local_key_count``): keys visible to every row are the ``ceil((first_pos + 1 - r) /
P)`` first, the causal end ``ceil((min(seq_len, last_pos + 1) - r) / P)``, a window's first key
``ceil((first_pos - sliding_window + 1 - r) / P)``; the causal and window masks and ALiBi compare
the global key position ``j * P + r`` with ``q_pos``. A query tile thus walks 1/P of the keys (and
the tiles past every row's causal bound are still skipped). A row may see no key of this rank
(position ``< r``): the online softmax keeps it at ``m_i = -inf, l_i = 0`` and the launch writes
out 0 and lse -inf. With ``PARTIAL`` each row's log-sum-exp (``(m_i + log2 l_i) * ln 2``) goes to
``lse`` ``[num_tokens, num_heads]`` float32 for the attention layer's merge across ranks. With
``CP_SIZE = 1`` and no ``PARTIAL`` the kernel compiles to the code it had before.

Layouts: query/out (and sink_query) ``[num_tokens, num_heads, head_size]``, lse ``[num_tokens,
num_heads]`` float32 (PARTIAL) (flattened batch, rows
located by ``query_start_loc``); key_cache/value_cache in either layout of
``paged_tiles.PagedKVLayout``: the Triton backend's ``[num_blocks, num_kv_heads, block_size,
head_size]``, or vLLM's original (the cuda backend's: K ``[num_blocks, num_kv_heads, head_size / x,
block_size, x]``, V ``[num_blocks, num_kv_heads, head_size, block_size]``), one kernel for both
through the row offsets of ``paged_tiles.dim_offsets``; block_tables ``[num_seqs, max_blocks]``
int32; seq_lens ``[num_seqs]`` int32; query_start_loc ``[num_seqs + 1]`` int32. Only the rows of
sequences ``[first_seq, first_seq + num_prefills)`` are written.

Bound: compute for long chunks. FLOPs ~ ``4 * num_heads * head_size * sum_s(query_len *
(context_len + query_len / 2))``; bytes ~ ``2 * num_kv_heads * head_size * element_size *
sum_s(seq_len * cdiv(query_len, BLOCK_M))`` before L2 reuse across the GQA group and query blocks
(with a window, ``min(seq_len, sliding_window + BLOCK_M)`` in place of ``seq_len``; with sinks,
``cdiv(attention_sinks, BLOCK_N) * BLOCK_N`` more keys at most, plus the program's ``sink_query``
rows: ``BLOCK_M * head_size * element_size``). Under context parallelism each rank's FLOPs and
bytes are ~1/P of these (the striping gives every rank an equal share of the causal triangle).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.paged_tiles import (
    attend_paged_range,
    check_paged_inputs,
    check_partial_inputs,
    compute_dtype,
    dim_offsets,
    dot_precision,
    fp8_kv_scales,
    fp8_scale_args,
    local_key_count,
    row_lse,
)
from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel


# first_seq (how many decodes precede the prefills) changes every step: specialised, as Triton
# specialises ints equal to 1 or divisible by 16, it would compile new kernels mid-serving.
# sliding_window varies per layer (Gemma): one kernel for every value, as for first_seq; so may
# attention_sinks; and cp_rank (one kernel for every rank).
@triton.jit(do_not_specialize=["first_seq", "sliding_window", "attention_sinks", "cp_rank"])
def _paged_prefill_kernel(
    out_ptr,
    lse_ptr,  # [num_tokens, num_heads] float32, written when PARTIAL
    query_ptr,
    sink_query_ptr,  # [num_tokens, num_heads, head_size], read when SINKS
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    alibi_slopes_ptr,  # [num_heads] float32, read when ALIBI
    learned_sinks_ptr,  # [num_heads], read when LEARNED_SINKS
    k_scale_ptr,  # [] float32, read when KV_FP8: the key cache's scale
    v_scale_ptr,  # [] float32, read when KV_FP8: the value cache's scale
    qk_scale,
    first_seq,
    sliding_window,  # read when WINDOW
    attention_sinks,  # read when SINKS
    soft_cap,  # the logit cap * log2(e), read when SOFT_CAP
    cp_rank,  # read when CP_SIZE > 1
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_sq_tok,
    stride_sq_head,
    stride_sq_dim,
    stride_o_tok,
    stride_o_head,
    stride_o_dim,
    stride_lse_tok,
    stride_lse_head,
    stride_k_block,
    stride_k_head,
    stride_k_slot,
    stride_k_chunk,
    stride_k_dim,
    stride_v_block,
    stride_v_head,
    stride_v_slot,
    stride_v_dim,
    stride_bt_seq,
    stride_bt_blk,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    K_CHUNK: tl.constexpr,  # elements per contiguous run of a key row (vLLM's original x); 0: one run
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    ALIBI: tl.constexpr,
    SINKS: tl.constexpr,  # needs WINDOW
    LEARNED_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # the caches hold float8_e4m3fn (paged_tiles.attend_paged_range)
    PACK_GQA: tl.constexpr,  # rows are (token, head of the KV group) pairs: see the module docstring
    CP_SIZE: tl.constexpr,  # context-parallel ranks (module docstring); 1: off
    PARTIAL: tl.constexpr,  # write each row's log-sum-exp to lse_ptr; 0 and -inf for no key
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    m_block = tl.program_id(0)
    seq = first_seq + tl.program_id(2)
    if PACK_GQA:
        kv_head = tl.program_id(1)
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_m = rows // NUM_QUERIES_PER_KV  # each row's token in the chunk
        head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV  # [BLOCK_M]
        head_col = head[:, None]
        first_row = m_block * BLOCK_M // NUM_QUERIES_PER_KV
        last_row = (m_block * BLOCK_M + BLOCK_M - 1) // NUM_QUERIES_PER_KV
    else:
        head = tl.program_id(1)
        kv_head = head // NUM_QUERIES_PER_KV
        head_col = head
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        first_row = m_block * BLOCK_M
        last_row = m_block * BLOCK_M + BLOCK_M - 1
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if first_row >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len
    # q in the dot products' dtype: the cache's; over an FP8 cache the query's, fp16 for bf16
    # (paged_tiles.attend_paged_range: e4m3 tiles widen to fp16 in half the conversions).
    q_ty = key_cache_ptr.dtype.element_ty
    if KV_FP8:
        q_ty = query_ptr.dtype.element_ty
        if q_ty == tl.bfloat16:
            q_ty = tl.float16
    qk_scale, v_scale = fp8_kv_scales(qk_scale, k_scale_ptr, v_scale_ptr, KV_FP8)

    offs_d = tl.arange(0, HEAD_DIM)
    k_dim_offs = dim_offsets(offs_d, stride_k_chunk, stride_k_dim, K_CHUNK)
    v_dim_offs = offs_d * stride_v_dim
    io_mask = (offs_m[:, None] < query_len) & (offs_d[None, :] < HEAD_SIZE)
    tokens = (query_start + offs_m).to(tl.int64)
    q = tl.load(
        query_ptr
        + tokens[:, None] * stride_q_tok
        + head_col * stride_q_head
        + offs_d[None, :] * stride_q_dim,
        mask=io_mask,
        other=0.0,
    ).to(q_ty)
    q_pos = context_len + offs_m

    alibi_row = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ALIBI:
        alibi_row += tl.load(alibi_slopes_ptr + head) * 1.4426950408889634  # log2(e): base-2 scores

    # Keys <= the tile's first query position are visible to all its rows (first_pos < seq_len
    # because the tile holds at least one real row); the tiles after that straddle the diagonal.
    # The bounds are global positions turned into this rank's key indices (local_key_count: the
    # same numbers without context parallelism); q_pos stays global.
    first_pos = context_len + first_row
    unmasked_lo = 0
    unmasked_end = local_key_count(first_pos + 1, cp_rank, CP_SIZE) // BLOCK_N * BLOCK_N
    kv_end = local_key_count(tl.minimum(seq_len, context_len + last_row + 1), cp_rank, CP_SIZE)
    kv_lo = unmasked_end
    if WINDOW:
        # Only keys > first_pos - sliding_window are visible to any row: start at that key's
        # tile, and mask every tile (the window's lower edge moves with the row, like the
        # diagonal). Keys before kv_lo are not even loaded: their blocks may be gone.
        kv_lo = local_key_count(tl.maximum(first_pos - sliding_window + 1, 0), cp_rank, CP_SIZE)
        unmasked_lo = kv_lo // BLOCK_N * BLOCK_N
        unmasked_end = unmasked_lo

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if LEARNED_SINKS:
        # The learned sink as a key of score sink_h and value 0, seen by every row first.
        sink = tl.load(learned_sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2 units
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
        l_i += 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # What every stage below shares (paged_tiles.attend_paged_range's tuples).
    CONFIG: tl.constexpr = (HEAD_SIZE, HEAD_DIM, BLOCK_SIZE, BLOCK_N, SOFT_CAP, ALIBI, DOT_PRECISION, KV_FP8)
    scores = (qk_scale, v_scale, sliding_window, soft_cap, alibi_row, cp_rank)
    state = (acc, l_i, m_i)
    keys = (key_cache_ptr + kv_head * stride_k_head, stride_k_block, stride_k_slot, k_dim_offs)
    values = (value_cache_ptr + kv_head * stride_v_head, stride_v_block, stride_v_slot, v_dim_offs)
    cache = (keys, values, (block_tables_ptr + seq * stride_bt_seq, stride_bt_blk))
    if SINKS:
        # The sinks the last row's window has passed: [0, sink_end). Each row keeps those its own
        # window has passed (SINK); a row that has passed none stays m_i = -inf, l_i = 0 until the
        # windowed stage, whose WINDOW guard handles such rows.
        sink_end = tl.maximum(tl.minimum(attention_sinks, kv_end - sliding_window), 0)
        sink_q = tl.load(
            sink_query_ptr
            + tokens[:, None] * stride_sq_tok
            + head_col * stride_sq_head
            + offs_d[None, :] * stride_sq_dim,
            # (sink_end broadcast by hand: Triton's interpreter refuses a scalar in a block mask)
            mask=io_mask & (offs_m[:, None] * 0 + sink_end > 0),
            other=0.0,
        ).to(q_ty)
        sink_rows = (sink_q, q_pos)
        state = attend_paged_range(
            state, sink_rows, 0, sink_end, 0, cache, scores, CONFIG, MASK_TAIL=True, SINK=True
        )
    rows = (q, q_pos)
    state = attend_paged_range(
        state,
        rows,
        unmasked_lo,
        unmasked_end,
        unmasked_lo,
        cache,
        scores,
        CONFIG,
        MASK_TAIL=False,
        CP_SIZE=CP_SIZE,
    )
    # If the unmasked stage was empty this one starts at key 0, or the window's first tile: without
    # a window every row sees key 0, so no row is fully masked in its first tile; with one, or with
    # context parallelism (a row may see no key of this rank at all), attend_paged_range keeps such
    # rows NaN-free.
    state = attend_paged_range(
        state,
        rows,
        unmasked_end,
        kv_end,
        kv_lo,
        cache,
        scores,
        CONFIG,
        MASK_TAIL=True,
        CAUSAL=True,
        WINDOW=WINDOW,
        CP_SIZE=CP_SIZE,
    )
    acc, l_i, m_i = state

    if PARTIAL:
        # A row that saw no key (acc 0, l_i 0) writes out 0 and lse -inf; the others divide by l_i.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            lse_ptr + tokens * stride_lse_tok + head * stride_lse_head,
            row_lse(l_i, m_i),
            mask=offs_m < query_len,
        )
    else:
        out = acc / l_i[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_o_tok + head_col * stride_o_head + offs_d[None, :] * stride_o_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    first_seq: int,
    num_prefills: int,
    max_query_len: int,
    out: torch.Tensor,
    *,
    sliding_window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    attention_sinks: int = 0,
    sink_query: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    enable_fp_fusion: bool = True,
    pack_gqa: bool = False,
    cp_rank: int = 0,
    cp_world_size: int = 1,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of sequences ``[first_seq, first_seq + num_prefills)`` over their paged
    context (cached prefix + the chunk itself); writes their rows of ``out``.

    query, out: [num_tokens, num_heads, head_size]; key_cache, value_cache: the Triton layout
    (both [num_blocks, num_kv_heads, block_size, head_size]) or vLLM's original (K [num_blocks,
    num_kv_heads, head_size / x, block_size, x], V [num_blocks, num_kv_heads, head_size,
    block_size]); block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32;
    query_start_loc: [num_seqs + 1] int32. ``max_query_len`` (host int) bounds every query_len of
    those sequences and sets the grid. The variants (sliding_window, alibi_slopes [num_heads]
    float32, logits_soft_cap) are ``AttentionBackend``'s. With ``attention_sinks > 0`` (and a
    window), ``sink_query`` (the shape of ``query``) scores the sinks outside each row's window.
    ``sinks`` ([num_heads]): gpt-oss's learned sink logits. ``enable_fp_fusion=False`` keeps every
    multiply and add rounded on its own (no FMA contraction), so that a (row, key tile) gives the
    same bits in the unmasked stage and in the masked one (the batch-invariant backend's need).
    ``pack_gqa``: a program's rows are (token, head) pairs of one KV head's group (module docstring).
    With float8_e4m3fn caches (kv_cache_dtype="fp8"), ``k_scale`` and ``v_scale`` (float32 scalars
    on the device) dequantize them: attention reads ``k * k_scale`` and ``v * v_scale``.

    With ``lse`` ([num_tokens, num_heads] float32) the launch is partial: it also writes each
    row's log-sum-exp, and a row that sees no key writes out 0 and lse -inf. With
    ``cp_world_size`` P > 1 (needs ``lse``) the caches hold only rank ``cp_rank``'s stripe of each
    context (module docstring); seq_lens and query_start_loc stay global.
    """
    layout = check_paged_inputs(query, key_cache, value_cache, block_tables, seq_lens, out)
    kv_fp8, kv_scales = fp8_scale_args(query, key_cache, k_scale, v_scale)
    check_partial_inputs(query, lse, cp_rank, cp_world_size, attention_sinks > 0 or sinks is not None)
    assert sinks is None or (sinks.shape == query.shape[1:2] and sinks.is_contiguous())
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape[0] == seq_lens.shape[0] + 1
    assert first_seq >= 0 and first_seq + num_prefills <= seq_lens.shape[0]
    streaming_sinks = attention_sinks > 0
    assert not streaming_sinks or (sliding_window is not None and sink_query is not None), "sinks need both"
    assert not streaming_sinks or (sink_query.shape == query.shape and sink_query.stride(2) == 1)
    _, num_heads, head_size = query.shape
    if num_prefills == 0 or max_query_len == 0:
        return out
    num_queries_per_kv = num_heads // layout.num_kv_heads
    grid = (
        (triton.cdiv(max_query_len * num_queries_per_kv, block_m), layout.num_kv_heads, num_prefills)
        if pack_gqa
        else (triton.cdiv(max_query_len, block_m), num_heads, num_prefills)
    )
    partial = lse is not None
    _paged_prefill_kernel[grid](
        out,
        lse if partial else out,  # a pointer never written without lse
        query,
        sink_query if streaming_sinks else query,  # a pointer never read without sinks
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        query if alibi_slopes is None else alibi_slopes,  # a pointer never read without ALiBi
        query if sinks is None else sinks,  # a pointer never read without learned sinks
        *kv_scales,
        scale * math.log2(math.e),
        first_seq,
        sliding_window or 0,
        attention_sinks,
        (logits_soft_cap or 0.0) * math.log2(math.e),
        cp_rank,
        *query.stride(),
        *(sink_query if streaming_sinks else query).stride(),
        *out.stride(),
        *(lse.stride() if partial else (0, 0)),
        *layout.key_strides,
        *layout.value_strides,
        *block_tables.stride(),
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        HEAD_SIZE=head_size,
        HEAD_DIM=triton.next_power_of_2(head_size),
        BLOCK_SIZE=layout.block_size,
        K_CHUNK=layout.key_chunk,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        WINDOW=sliding_window is not None,
        SOFT_CAP=logits_soft_cap is not None,
        ALIBI=alibi_slopes is not None,
        SINKS=streaming_sinks,
        LEARNED_SINKS=sinks is not None,
        DOT_PRECISION=dot_precision(compute_dtype(query, key_cache) == torch.float32),
        KV_FP8=kv_fp8,
        PACK_GQA=pack_gqa,
        CP_SIZE=cp_world_size,
        PARTIAL=partial,
        num_warps=num_warps,
        num_stages=num_stages,
        enable_fp_fusion=enable_fp_fusion,
        **pdl_options(query.device),
    )
    return out
