"""Paged decode attention: one new query token per sequence, split along the context.

Algorithm: FlashDecoding (Dao et al. 2023; vLLM's original PagedAttention "V2", vLLM's design). Each
sequence's context is cut into partitions of ``partition_size`` tokens (a runtime value: the
backend sizes it per launch, see ``decode_partition_size``); every partition runs the
online softmax of ``paged_tiles.attend_paged_range`` independently, then a second kernel merges the
partitions. Splitting the context keeps the GPU full when ``num_seqs * num_kv_heads`` is small and
contexts are long, which V1 (one program per sequence and head) cannot.

GQA/MQA: a program owns one *KV head* and computes all ``num_queries_per_kv`` query heads that share
it, as the rows of its ``tl.dot`` (padded to ``BLOCK_H`` >= 16, the tensor-core minimum). Each K/V
tile is read from memory once per group instead of once per query head, fixing the re-read known
as PagedAttention V1's weakness on GQA models.

Kernel 1, ``_paged_decode_kernel``, grid ``(num_seqs, num_kv_heads, num_partitions)``:
  loads the group's queries ``[BLOCK_H, HEAD_DIM]``, walks its partition's tokens ``BLOCK_N`` at a
  time (full tiles unmasked, one masked tail tile), and writes, per query head, the partition's
  running max ``m_i`` (log2 units), sum ``l_i`` and unnormalized ``acc``. Partitions count from the
  tile holding a sliding window's first key ``seq_len - sliding_window`` (from key 0 without a
  window), so a windowed layer launches partitions for its window, not its context; a partition
  starting at or past ``seq_len`` returns at once and writes nothing. A sequence with one live
  partition gets ``acc / l_i`` written straight to the output; when that holds for the whole launch
  (``num_partitions == 1``) kernel 2 is not launched and the workspace is a stub. (Not a constexpr:
  a variant compiled for one-partition launches would first compile mid-run, at the first step
  whose longest context fits one partition.)
  With attention sinks (``SINKS``; StreamingLLM, Xiao et al. 2023) the window's first partition
  (the one holding ``window_start``; exactly one is live and starts at or before it) first runs one
  more stage: the sinks the window has passed, keys ``[0, min(attention_sinks, window_start))``,
  scored with the group's rows of ``sink_query`` into the same running state. The partitions and
  the reduce are unchanged: the sinks are part of that partition's ``m_i``, ``l_i`` and ``acc``.
  Nothing between the sinks and the window is read (those blocks may be freed: NaN).
Kernel 2, ``paged_decode_reduce.paged_decode_reduce_kernel``, grid ``(num_seqs, num_heads)``:
  merges the live partitions of one query head into its output (skipped by the host when the
  launch has one partition; a program whose sequence has one exits).

Query groups (speculative decoding's verifications, expanded into one decode per token, vLLM v0's
batch expansion; ``query_lens`` and ``QUERY_GROUP``): a request verifying k drafts arrives as k +
1 sequences of consecutive contexts ``L - k .. L`` over the same block table, which would read its
context k + 1 times. Instead the last of them (``query_lens[s] = q``, the others 0) attends for
all q: its program's rows are the ``q * num_queries_per_kv`` pairs (token ``r // num_queries_per_kv``,
head ``r % num_queries_per_kv``) in one ``BLOCK_H``-row tile, row r at position ``L - q + r //
num_queries_per_kv``, so each K/V tile is read once for the q tokens and all their heads (the
GQA packing above, along one more axis; vLLM's unified Triton attention packs a query block the
same way). Keys below ``L - q + 1`` are visible to every row and run unmasked; the tiles from
there are masked causally per row (``paged_tiles``' CAUSAL, with EMPTY_ROWS: a partition may
start past a row's last key). The partitions stay those of each row's own sequence, so the reduce
is unchanged: a row whose context fits partition 0 is written by it, the others spill each
partition holding a key they see. The other sequences' programs exit at once. Not with a
window (each token's window starts elsewhere), StreamingLLM sinks or context parallelism. At
Llama-3-8B's 4 query heads per KV head and k = 3 the tile is the 16 rows a lone decode pads to
anyway, so a verification reads and computes what one decode does.

Context parallelism (``CP_SIZE = P > 1``, with ``PARTIAL``; Striped Attention's layout, merged as
in Ring/Tree Attention): rank ``r``'s cache holds the keys at global positions ``t = j * P + r`` at
local index ``j`` of each block table, and ``seq_lens`` stay global. Both kernels turn the bounds
into local indices once per program (``paged_tiles.local_key_count``: ``ceil((n - r) / P)`` keys
below global ``n``), so the context ``[window_start, seq_len)`` becomes ``ceil((seq_len - r) / P)``
local keys from ``ceil((window_start - r) / P)``, and partitions, tiles and the reduce run over
those exactly as over an unsplit context; ALiBi scores the global key position. Each program then
reads 1/P of the K/V bytes, and the grid's partition axis shrinks to ``cdiv(cdiv(max_seq_len, P),
partition_size)``. With ``PARTIAL`` the launch also writes each query head's log-sum-exp (natural
log of its softmax denominator) to ``lse`` ``[num_seqs, num_heads]`` float32 -- kernel 1 for a
one-partition sequence, the reduce otherwise (``max_p m_p + log2(sum w_p l_p)``, back to base e) --
and a query that sees none of this rank's keys (position 0 on rank 1, a window shorter than P) gets
out 0 and lse -inf from partition 0 with no tile read. The attention layer merges the P ranks'
(out, lse). With ``CP_SIZE = 1`` and no ``PARTIAL`` the kernels compile as before (sm_90 PTX:
kernel 1 the same instruction count; the reduce 5 fewer, its skip test being ``num_parts <= 1``).

``num_partitions = cdiv(max_seq_len, partition_size)`` (with a window, ``cdiv(min(max_seq_len,
sliding_window + BLOCK_N - 1), partition_size)``) comes from a host bound, not from the device's
``seq_lens``, so a CUDA graph captured with ``max_seq_len = max_model_len`` stays valid for every
replay; the programs past a sequence's end exit immediately.

Layouts: query/output (and sink_query) ``[num_seqs, num_heads, head_size]``, lse ``[num_seqs,
num_heads]`` float32 (PARTIAL); key_cache/value_cache
``[num_blocks, num_kv_heads, block_size, head_size]``; block_tables ``[num_seqs, max_blocks]``
int32; seq_lens ``[num_seqs]`` int32; workspace (float32) partial_out ``[num_seqs, num_heads,
num_partitions, HEAD_DIM]``, max_logits/exp_sums ``[num_seqs, num_heads, num_partitions]``.

Bound: memory. Bytes ~ ``2 * sum(seq_lens) * num_kv_heads * head_size * element_size`` (each K/V
element read once; with query groups, the sum over the groups' last sequences only; with a window,
``min(seq_len, sliding_window)`` per sequence plus at most one partly masked tile; with sinks,
``min(attention_sinks, window_start)`` more in ``cdiv(attention_sinks, BLOCK_N)`` masked tiles,
and one more query row per KV head); FLOPs ~ ``4 * sum(seq_lens) * num_heads * head_size``, i.e.
~2 * num_queries_per_kv FLOPs per byte at 16 bits (times the group's tokens with query groups),
far below any GPU's ridge point. The workspace traffic is ``num_partitions * num_heads *
head_size * 4`` bytes per sequence, < 1% of the K/V bytes at partitions of 512 tokens. Under
context parallelism a rank reads ``ceil(seq_len / P)`` keys per sequence (bytes and FLOPs / P) and
writes ``num_heads * 4`` more bytes of lse.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.decode_append import append_args, rotate_and_append
from pagedllm.kernels.triton.paged_decode_reduce import (
    REDUCE_BLOCK_P,
    WORKSPACE_STRIDES,
    paged_decode_reduce_kernel,
)
from pagedllm.kernels.triton.paged_tiles import (
    attend_paged_range,
    check_paged_inputs,
    check_partial_inputs,
    compute_dtype,
    dot_precision,
    fp8_kv_scales,
    fp8_scale_args,
    local_key_count,
    row_lse,
    window_start_of,
)
from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel

# attention_sinks is a runtime value for the reason sliding_window is: it may differ per layer (the
# workspace's strides: paged_decode_reduce.WORKSPACE_STRIDES).


@triton.jit(
    do_not_specialize=["partition_size", "sliding_window", "attention_sinks", "cp_rank", *WORKSPACE_STRIDES]
)
def _paged_decode_kernel(
    out_ptr,
    lse_ptr,  # [num_seqs, num_heads] float32, written when PARTIAL
    partial_out_ptr,
    max_logits_ptr,
    exp_sums_ptr,
    query_ptr,
    sink_query_ptr,  # [num_seqs, num_heads, head_size], read when SINKS
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_lens_ptr,  # [num_seqs] int32, read when QUERY_GROUP > 1 (paged_decode's decode_query_lens)
    alibi_slopes_ptr,  # [num_heads] float32, read when ALIBI
    learned_sinks_ptr,  # [num_heads], read when LEARNED_SINKS
    k_scale_ptr,  # [] float32, read when KV_FP8: the key cache's scale
    v_scale_ptr,  # [] float32, read when KV_FP8: the value cache's scale
    key_new_ptr,  # [num_seqs, num_kv_heads, head_size], read when APPEND: this step's keys
    value_new_ptr,  # the same, this step's values
    slot_mapping_ptr,  # [num_seqs], read when APPEND: where the new token's K/V go
    cos_sin_ptr,  # [rows, head_size] = [cos | sin], read when ROTARY
    cos_sin_index_ptr,  # [num_seqs], each sequence's row of cos_sin, read when ROTARY
    qk_scale,
    sliding_window,  # 0: no window
    attention_sinks,  # read when SINKS
    soft_cap,  # the logit cap * log2(e), read when SOFT_CAP
    cp_rank,  # read when CP_SIZE > 1
    stride_q_seq,
    stride_q_head,
    stride_q_dim,
    stride_sq_seq,
    stride_sq_head,
    stride_sq_dim,
    stride_o_seq,
    stride_o_head,
    stride_o_dim,
    stride_lse_seq,
    stride_lse_head,
    stride_po_seq,
    stride_po_head,
    stride_po_part,
    stride_po_dim,
    stride_ml_seq,
    stride_ml_head,
    stride_ml_part,  # shared by max_logits and exp_sums
    stride_k_block,
    stride_k_head,
    stride_k_slot,
    stride_k_dim,
    stride_v_block,
    stride_v_head,
    stride_v_slot,
    stride_v_dim,
    stride_bt_seq,
    stride_bt_blk,
    stride_kn_seq,
    stride_kn_head,
    stride_kn_dim,
    stride_vn_seq,
    stride_vn_head,
    stride_vn_dim,
    stride_cos_sin,
    NUM_QUERIES_PER_KV: tl.constexpr,
    QUERY_GROUP: tl.constexpr,  # the most query tokens a program attends for; 1: one per sequence
    BLOCK_H: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    partition_size,
    BLOCK_N: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    ALIBI: tl.constexpr,
    SINKS: tl.constexpr,
    LEARNED_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # the caches hold float8_e4m3fn (paged_tiles.attend_paged_range)
    CP_SIZE: tl.constexpr,  # context-parallel ranks (module docstring); 1: off
    PARTIAL: tl.constexpr,  # write each row's log-sum-exp to lse_ptr; 0 and -inf for no key
    APPEND: tl.constexpr,  # write this step's K/V first (decode_append.py): a decode-only step
    ROTARY: tl.constexpr,  # with APPEND: rotate the query rows and the new key
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    # q in the dot products' dtype: the cache's; over an FP8 cache the query's, fp16 for bf16
    # (paged_tiles.attend_paged_range: e4m3 tiles widen to fp16 in half the conversions).
    q_ty = key_cache_ptr.dtype.element_ty
    if KV_FP8:
        q_ty = query_ptr.dtype.element_ty
        if q_ty == tl.bfloat16:
            q_ty = tl.float16
    qk_scale, v_scale = fp8_kv_scales(qk_scale, k_scale_ptr, v_scale_ptr, KV_FP8)
    # partition_size (a multiple of BLOCK_N: tiles never straddle two partitions, asserted by the
    # host) is a runtime value: the engine picks it per launch, and a constexpr would compile a
    # kernel per value in the middle of serving.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    global_len = tl.load(seq_lens_ptr + seq)
    # The single query sits at global_len - 1 and sees keys >= window_start (all with no window).
    # Partitions count from the window's first tile, so a windowed layer's grid spans the window,
    # not the context. From here on key indices are this rank's (local_key_count: the same
    # numbers without context parallelism).
    seq_len = local_key_count(global_len, cp_rank, CP_SIZE)
    window_start = local_key_count(window_start_of(global_len, sliding_window), cp_rank, CP_SIZE)
    start = window_start // BLOCK_N * BLOCK_N + part * partition_size
    end = tl.minimum(start + partition_size, seq_len)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    k_dim_offs = offs_d * stride_k_dim
    v_dim_offs = offs_d * stride_v_dim
    if QUERY_GROUP == 1:
        # The rows are the group's heads, one query at the context's last position; no key of
        # the range is past it.
        head_in_group = offs_h
        row_valid = offs_h < NUM_QUERIES_PER_KV
        # Each row's sequence, for [BLOCK_H] and [BLOCK_H, HEAD_DIM] offsets: the program's.
        row_seq_1d = seq
        row_seq = seq
        q_pos = tl.zeros([BLOCK_H], dtype=tl.int32) + global_len - 1
        first_causal = end
    else:
        # Query groups (module docstring): the last of a request's q_len sequences attends for
        # them all, row r its token r // NUM_QUERIES_PER_KV at position global_len - q_len + that;
        # the request's other sequences (q_len 0) exit. Keys from first_causal on are past the
        # first token: their tiles mask causally.
        q_len = tl.load(query_lens_ptr + seq)
        if q_len == 0:
            return
        tok = offs_h // NUM_QUERIES_PER_KV
        head_in_group = offs_h % NUM_QUERIES_PER_KV
        row_valid = tok < q_len
        row_seq_1d = seq - q_len + 1 + tok
        row_seq = row_seq_1d[:, None]
        q_pos = global_len - q_len + tok
        first_causal = tl.minimum(end, seq_len - q_len + 1)
    heads = kv_head * NUM_QUERIES_PER_KV + head_in_group
    row_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_SIZE)
    if PARTIAL:  # noqa: SIM102 (a constexpr test on its own: kernels without lse keep no branch)
        if window_start >= seq_len:
            # This rank holds no key the query sees: out 0 and lse -inf, from partition 0 (the
            # one every launch has).
            if part == 0:
                tl.store(
                    out_ptr
                    + seq * stride_o_seq
                    + heads[:, None] * stride_o_head
                    + offs_d[None, :] * stride_o_dim,
                    tl.zeros([BLOCK_H, HEAD_DIM], dtype=out_ptr.dtype.element_ty),
                    mask=row_mask,
                )
                no_key = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
                head_mask = offs_h < NUM_QUERIES_PER_KV
                tl.store(lse_ptr + seq * stride_lse_seq + heads * stride_lse_head, no_key, mask=head_mask)
            return
    if start >= seq_len:
        return
    # The window's first tile (the only one cut by its lower edge, in partition 0) is masked on its
    # own; the tiles before it are never read.
    lo = start
    head_end = lo
    if window_start > start:
        head_end = tl.minimum(lo + BLOCK_N, end)
    full_end = tl.maximum(start + (first_causal - start) // BLOCK_N * BLOCK_N, head_end)

    keys = (key_cache_ptr + kv_head * stride_k_head, stride_k_block, stride_k_slot, k_dim_offs)
    values = (value_cache_ptr + kv_head * stride_v_head, stride_v_block, stride_v_slot, v_dim_offs)
    q_rows = query_ptr + row_seq * stride_q_seq + heads[:, None] * stride_q_head
    q = tl.load(q_rows + offs_d[None, :] * stride_q_dim, mask=row_mask, other=0.0)
    if APPEND:
        q = rotate_and_append(
            q,
            (q_rows, stride_q_dim, row_mask),
            seq,
            end == seq_len,  # this partition holds the new token's key: written before it is read
            (key_new_ptr + seq * stride_kn_seq + kv_head * stride_kn_head, stride_kn_dim),
            (value_new_ptr + seq * stride_vn_seq + kv_head * stride_vn_head, stride_vn_dim),
            slot_mapping_ptr,
            (cos_sin_ptr, cos_sin_index_ptr, stride_cos_sin),
            (keys, values, (k_scale_ptr, v_scale_ptr)),
            offs_d,
            CONFIG=(HEAD_SIZE, BLOCK_SIZE, ROTARY, KV_FP8),
        )
    q = q.to(q_ty)
    alibi_row = tl.zeros([BLOCK_H], dtype=tl.float32)
    if ALIBI:
        slopes = tl.load(alibi_slopes_ptr + heads, mask=row_valid, other=0.0)
        alibi_row += slopes * 1.4426950408889634  # log2(e): base-2 scores

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    if LEARNED_SINKS:
        # The learned sink enters partition 0 (always live) as a key of score sink_h and value 0:
        # m_i = sink_h, l_i = exp2(0) = 1, acc = 0. The reduce then counts it exactly once.
        sink = tl.load(learned_sinks_ptr + heads, mask=row_valid, other=float("-inf")).to(tl.float32)
        m_i = tl.where(part == 0, sink * 1.4426950408889634, m_i)
        l_i = tl.where((part == 0) & row_valid, 1.0, l_i)
    # What every stage below shares (paged_tiles.attend_paged_range's tuples).
    state = (acc, l_i, m_i)
    cache = (keys, values, (block_tables_ptr + seq * stride_bt_seq, stride_bt_blk))
    scores = (qk_scale, v_scale, sliding_window, soft_cap, alibi_row, cp_rank)
    CONFIG: tl.constexpr = (HEAD_SIZE, HEAD_DIM, BLOCK_SIZE, BLOCK_N, SOFT_CAP, ALIBI, DOT_PRECISION, KV_FP8)
    if SINKS:
        # The sinks the window has passed, [0, sink_end), for the window's first partition only
        # (sink_end = 0 elsewhere: no tile, and the sink query is not even loaded). They end at or
        # before window_start, so they never overlap the window's tiles below; the stage is the
        # first this program runs and every row sees key 0, so no row starts fully masked.
        sink_end = tl.minimum(attention_sinks, window_start) * (start <= window_start)
        sink_q = tl.load(
            sink_query_ptr
            + seq * stride_sq_seq
            + heads[:, None] * stride_sq_head
            + offs_d[None, :] * stride_sq_dim,
            # (sink_end broadcast by hand: Triton's interpreter refuses a scalar in a block mask)
            mask=row_mask & (offs_h[:, None] * 0 + sink_end > 0),
            other=0.0,
        ).to(q_ty)
        state = attend_paged_range(
            state, (sink_q, q_pos), 0, sink_end, 0, cache, scores, CONFIG, MASK_TAIL=True
        )
    # The window's first tile, masked below window_start (and at seq_len); then full tiles
    # without per-token masks; then the tiles cut by seq_len, and with query groups those past
    # first_causal, masked causally (a row past which a partition starts sees none of its keys).
    rows = (q, q_pos)
    # (CP_SIZE for ALiBi's key positions: the ranges are local already.)
    state = attend_paged_range(
        state, rows, lo, head_end, window_start, cache, scores, CONFIG, MASK_TAIL=True, CP_SIZE=CP_SIZE
    )
    state = attend_paged_range(
        state, rows, head_end, full_end, head_end, cache, scores, CONFIG, MASK_TAIL=False, CP_SIZE=CP_SIZE
    )
    grouped: tl.constexpr = QUERY_GROUP > 1
    state = attend_paged_range(
        state,
        rows,
        full_end,
        end,
        full_end,
        cache,
        scores,
        CONFIG,
        MASK_TAIL=True,
        CAUSAL=grouped,
        CP_SIZE=CP_SIZE,
        EMPTY_ROWS=grouped,
    )
    acc, l_i, m_i = state
    if grouped:
        # Per row, as the reduce sees that row's sequence (no window here, so part 0 starts at
        # key 0): a context of one partition is written here, any other spills every partition
        # that holds a key the row sees.
        # (part broadcast by hand: Triton's interpreter refuses a scalar in a block mask)
        row_len, row_part = q_pos + 1, offs_h * 0 + part
        direct = row_valid & (row_part == 0) & (row_len - start <= partition_size)
        spill = row_valid & (start < row_len) & ((row_part > 0) | (row_len - start > partition_size))
        tl.store(
            out_ptr
            + row_seq * stride_o_seq
            + heads[:, None] * stride_o_head
            + offs_d[None, :] * stride_o_dim,
            (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
            mask=row_mask & direct[:, None],
        )
        ml_offs = row_seq_1d * stride_ml_seq + heads * stride_ml_head + part * stride_ml_part
        tl.store(max_logits_ptr + ml_offs, m_i, mask=spill)
        tl.store(exp_sums_ptr + ml_offs, l_i, mask=spill)
        po_offs = row_seq * stride_po_seq + heads[:, None] * stride_po_head + offs_d[None, :] * stride_po_dim
        tl.store(partial_out_ptr + po_offs + part * stride_po_part, acc, mask=spill[:, None])
    else:
        # A sequence whose context fits one partition (every one when num_partitions is 1; under a CUDA
        # graph captured for max_model_len, most of them) has nothing to merge: its only program
        # writes the output, and the reduce pass skips it.
        if tl.cdiv(seq_len - start, partition_size) == 1 and part == 0:
            out = acc / l_i[:, None]
            tl.store(
                out_ptr
                + seq * stride_o_seq
                + heads[:, None] * stride_o_head
                + offs_d[None, :] * stride_o_dim,
                out.to(out_ptr.dtype.element_ty),
                mask=row_mask,
            )
            if PARTIAL:
                lse_offs = seq * stride_lse_seq + heads * stride_lse_head
                tl.store(lse_ptr + lse_offs, row_lse(l_i, m_i), mask=offs_h < NUM_QUERIES_PER_KV)
        else:
            head_mask = offs_h < NUM_QUERIES_PER_KV
            ml_offs = seq * stride_ml_seq + heads * stride_ml_head + part * stride_ml_part
            tl.store(max_logits_ptr + ml_offs, m_i, mask=head_mask)
            tl.store(exp_sums_ptr + ml_offs, l_i, mask=head_mask)
            tl.store(
                partial_out_ptr
                + seq * stride_po_seq
                + heads[:, None] * stride_po_head
                + part * stride_po_part
                + offs_d[None, :] * stride_po_dim,
                acc,
                mask=head_mask[:, None],
            )


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
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
    cp_rank: int = 0,
    cp_world_size: int = 1,
    lse: torch.Tensor | None = None,
    query_lens: torch.Tensor | None = None,
    max_query_len: int = 1,
    append: tuple | None = None,
    partition_size: int = 512,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of each sequence's single new query over its paged context; writes ``out``.

    query, out: [num_seqs, num_heads, head_size]; key_cache, value_cache: [num_blocks,
    num_kv_heads, block_size, head_size]; block_tables: [num_seqs, max_blocks] int32; seq_lens:
    [num_seqs] int32, each in [1, max_seq_len]. ``max_seq_len`` is a host-side bound (e.g.
    max_model_len under CUDA graphs) that sets the number of partitions; no device value is read.
    The variants (sliding_window, alibi_slopes [num_heads] float32, logits_soft_cap) are
    ``AttentionBackend``'s; with a window, partitions wholly before it exit at once. With
    ``attention_sinks > 0`` (and a window), ``sink_query`` (the shape of ``query``) scores the
    sinks outside each sequence's window. ``sinks`` ([num_heads]): gpt-oss's learned sink logits.
    With float8_e4m3fn caches (kv_cache_dtype="fp8"), ``k_scale`` and ``v_scale`` (float32 scalars
    on the device) dequantize them: attention reads ``k * k_scale`` and ``v * v_scale``.

    With ``lse`` ([num_seqs, num_heads] float32) the launch is partial: it also writes each row's
    log-sum-exp, and a query that sees no key writes out 0 and lse -inf. With ``cp_world_size`` P
    > 1 (needs ``lse``) the caches hold only rank ``cp_rank``'s stripe of each context (module
    docstring); seq_lens and ``max_seq_len`` stay global.

    ``query_lens`` ([num_seqs] int32) with ``max_query_len`` > 1: query groups (module docstring).
    Sequence ``s`` with ``query_lens[s] = q > 0`` is the last of q consecutive sequences that are
    one request's tokens at consecutive positions (a verification expanded into decodes, their
    seq_lens ``seq_lens[s] - q + 1 .. seq_lens[s]`` and block tables the same), and attends for them
    all; the others have 0; q <= ``max_query_len``. Not with a window, sinks or ``lse``.

    ``append``: ``(key, value, slot_mapping, rotary)``, a decode-only step's K/V written (and
    rotated) by this launch instead of ``reshape_and_cache`` before it (decode_append.py); not with
    query groups, StreamingLLM sinks or context parallelism.
    """
    layout = check_paged_inputs(query, key_cache, value_cache, block_tables, seq_lens, out)
    kv_fp8, kv_scales = fp8_scale_args(query, key_cache, k_scale, v_scale)
    check_partial_inputs(query, lse, cp_rank, cp_world_size, attention_sinks > 0 or sinks is not None)
    assert sinks is None or (sinks.shape == query.shape[1:2] and sinks.is_contiguous())
    assert layout.key_chunk == 0, "paged_decode reads the Triton layout (the cuda backend has its own decode)"
    assert block_tables.shape[0] == seq_lens.shape[0] == query.shape[0], "one query per sequence"
    streaming_sinks = attention_sinks > 0
    assert not streaming_sinks or (sliding_window is not None and sink_query is not None), "sinks need both"
    assert not streaming_sinks or (sink_query.shape == query.shape and sink_query.stride(2) == 1)
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[1:3]
    assert partition_size % block_n == 0 and partition_size % block_size == 0, (
        f"partition_size {partition_size} must be a multiple of block_n {block_n} and block_size {block_size}"
    )
    if num_seqs == 0:
        return out
    query_group = max_query_len if query_lens is not None else 1
    if query_group > 1:
        assert sliding_window is None and attention_sinks == 0 and lse is None, (
            "query groups: plain layers only"
        )
        assert query_lens.shape == (num_seqs,) and query_lens.dtype == torch.int32
    plain = query_group == 1 and cp_world_size == 1 and not streaming_sinks
    append_pointers, append_strides, append_flags = append_args(append, query, num_kv_heads, plain)
    num_queries_per_kv = num_heads // num_kv_heads
    head_dim = triton.next_power_of_2(head_size)
    # This rank's keys of the longest context; a window's start within a tile of its first tile:
    # it spans at most (its local keys) + block_n - 1.
    attended_bound = triton.cdiv(max_seq_len, cp_world_size)
    if sliding_window is not None:
        attended_bound = min(attended_bound, triton.cdiv(sliding_window, cp_world_size) + block_n - 1)
    num_partitions = triton.cdiv(attended_bound, partition_size)
    single_partition = num_partitions == 1
    # float32 scratch for kernel 1's per-partition state; a [.., 1, ..] stub when it is unused.
    workspace_parts = 1 if single_partition else num_partitions
    partial_out = torch.empty(
        num_seqs, num_heads, workspace_parts, head_dim, dtype=torch.float32, device=query.device
    )
    max_logits = torch.empty(num_seqs, num_heads, workspace_parts, dtype=torch.float32, device=query.device)
    exp_sums = torch.empty_like(max_logits)

    # Without lse: a pointer never written, and strides that do not follow the workspace's.
    partial = lse is not None
    lse, lse_strides = (lse, lse.stride()) if partial else (max_logits, (0, 0))
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out,
        lse,
        partial_out,
        max_logits,
        exp_sums,
        query,
        sink_query if streaming_sinks else query,  # a pointer never read without sinks
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_lens if query_group > 1 else seq_lens,  # a pointer never read without query groups
        query if alibi_slopes is None else alibi_slopes,  # a pointer never read without ALiBi
        query if sinks is None else sinks,  # a pointer never read without learned sinks
        *kv_scales,
        *append_pointers,
        scale * math.log2(math.e),
        sliding_window or 0,
        attention_sinks,
        (logits_soft_cap or 0.0) * math.log2(math.e),
        cp_rank,
        *query.stride(),
        *(sink_query if streaming_sinks else query).stride(),
        *out.stride(),
        *lse_strides,
        *partial_out.stride(),
        *max_logits.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_tables.stride(),
        *append_strides,
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        QUERY_GROUP=query_group,
        BLOCK_H=max(16, triton.next_power_of_2(query_group * num_queries_per_kv)),
        HEAD_SIZE=head_size,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        partition_size=partition_size,
        BLOCK_N=block_n,
        SOFT_CAP=logits_soft_cap is not None,
        ALIBI=alibi_slopes is not None,
        SINKS=streaming_sinks,
        LEARNED_SINKS=sinks is not None,
        DOT_PRECISION=dot_precision(compute_dtype(query, key_cache) == torch.float32),
        KV_FP8=kv_fp8,
        CP_SIZE=cp_world_size,
        PARTIAL=partial,
        **append_flags,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_options(query.device),
    )
    if not single_partition:
        paged_decode_reduce_kernel[(num_seqs, num_heads)](
            out,
            lse,
            partial_out,
            max_logits,
            exp_sums,
            seq_lens,
            *out.stride(),
            *lse_strides,
            *partial_out.stride(),
            *max_logits.stride(),
            partition_size=partition_size,
            sliding_window=sliding_window or 0,
            cp_rank=cp_rank,
            HEAD_SIZE=head_size,
            HEAD_DIM=head_dim,
            BLOCK_N=block_n,
            BLOCK_P=REDUCE_BLOCK_P,
            CP_SIZE=cp_world_size,
            PARTIAL=partial,
            **pdl_options(query.device),
        )
    return out
