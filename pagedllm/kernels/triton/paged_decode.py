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
Kernel 2, ``_paged_decode_reduce_kernel``, grid ``(num_seqs, num_heads)``:
  reads the live partitions of one query head (``cdiv(seq_len - first tile's key,
  partition_size)`` of them; with one, kernel 1 wrote the output and the program exits), rescales each by
  ``exp2(m_p - max_p m_p)`` and writes ``sum(w_p * acc_p) / sum(w_p * l_p)``.

``num_partitions = cdiv(max_seq_len, partition_size)`` (with a window, ``cdiv(min(max_seq_len,
sliding_window + BLOCK_N - 1), partition_size)``) comes from a host bound, not from the device's
``seq_lens``, so a CUDA graph captured with ``max_seq_len = max_model_len`` stays valid for every
replay; the programs past a sequence's end exit immediately.

Layouts: query/output (and sink_query) ``[num_seqs, num_heads, head_size]``; key_cache/value_cache
``[num_blocks, num_kv_heads, block_size, head_size]``; block_tables ``[num_seqs, max_blocks]``
int32; seq_lens ``[num_seqs]`` int32; workspace (float32) partial_out ``[num_seqs, num_heads,
num_partitions, HEAD_DIM]``, max_logits/exp_sums ``[num_seqs, num_heads, num_partitions]``.

Bound: memory. Bytes ~ ``2 * sum(seq_lens) * num_kv_heads * head_size * element_size`` (each K/V
element read once; with a window, ``min(seq_len, sliding_window)`` per sequence plus at most one
partly masked tile; with sinks, ``min(attention_sinks, window_start)`` more in ``cdiv(
attention_sinks, BLOCK_N)`` masked tiles, and one more query row per KV head); FLOPs ~ ``4 *
sum(seq_lens) * num_heads * head_size``, i.e. ~2 * num_queries_per_kv FLOPs per byte at 16 bits,
far below any GPU's ridge point. The workspace traffic is ``num_partitions * num_heads *
head_size * 4`` bytes per sequence, < 1% of the K/V bytes at partitions of 512 tokens.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.paged_tiles import (
    attend_paged_range,
    check_paged_inputs,
    compute_dtype,
    dot_precision,
    fp8_kv_scales,
    fp8_scale_args,
)
from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel

_REDUCE_BLOCK_P = 32


@triton.jit
def _window_start(seq_len, sliding_window):
    """The first key a sequence's last token sees: seq_len - sliding_window (0 without a window)."""
    return tl.maximum(seq_len - sliding_window, 0) * (sliding_window > 0)


# attention_sinks is a runtime value for the reason sliding_window is: it may differ per layer. The
# workspace's strides follow the number of partitions, which changes from step to step: Triton
# would otherwise compile a variant whenever one of them turns 1 or a multiple of 16.
_WORKSPACE_STRIDES = ["stride_po_seq", "stride_po_head", "stride_ml_seq", "stride_ml_head"]


@triton.jit(do_not_specialize=["partition_size", "sliding_window", "attention_sinks", *_WORKSPACE_STRIDES])
def _paged_decode_kernel(
    out_ptr,
    partial_out_ptr,
    max_logits_ptr,
    exp_sums_ptr,
    query_ptr,
    sink_query_ptr,  # [num_seqs, num_heads, head_size], read when SINKS
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    alibi_slopes_ptr,  # [num_heads] float32, read when ALIBI
    learned_sinks_ptr,  # [num_heads], read when LEARNED_SINKS
    k_scale_ptr,  # [] float32, read when KV_FP8: the key cache's scale
    v_scale_ptr,  # [] float32, read when KV_FP8: the value cache's scale
    qk_scale,
    sliding_window,  # 0: no window
    attention_sinks,  # read when SINKS
    soft_cap,  # the logit cap * log2(e), read when SOFT_CAP
    stride_q_seq,
    stride_q_head,
    stride_q_dim,
    stride_sq_seq,
    stride_sq_head,
    stride_sq_dim,
    stride_o_seq,
    stride_o_head,
    stride_o_dim,
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
    NUM_QUERIES_PER_KV: tl.constexpr,
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
    seq_len = tl.load(seq_lens_ptr + seq)
    # The single query sits at seq_len - 1 and sees keys >= window_start (all with no window).
    # Partitions count from the window's first tile, so a windowed layer's grid spans the window,
    # not the context.
    window_start = _window_start(seq_len, sliding_window)
    start = window_start // BLOCK_N * BLOCK_N + part * partition_size
    end = tl.minimum(start + partition_size, seq_len)
    if start >= seq_len:
        return
    # The window's first tile (the only one cut by its lower edge, in partition 0) is masked on its
    # own; the tiles before it are never read.
    lo = start
    head_end = lo
    if window_start > start:
        head_end = tl.minimum(lo + BLOCK_N, end)
    full_end = tl.maximum(start + (end - start) // BLOCK_N * BLOCK_N, head_end)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    k_dim_offs = offs_d * stride_k_dim
    v_dim_offs = offs_d * stride_v_dim
    heads = kv_head * NUM_QUERIES_PER_KV + offs_h
    row_mask = (offs_h[:, None] < NUM_QUERIES_PER_KV) & (offs_d[None, :] < HEAD_SIZE)
    q = tl.load(
        query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :] * stride_q_dim,
        mask=row_mask,
        other=0.0,
    ).to(q_ty)
    q_pos = tl.zeros([BLOCK_H], dtype=tl.int32) + seq_len - 1
    alibi_row = tl.zeros([BLOCK_H], dtype=tl.float32)
    if ALIBI:
        slopes = tl.load(alibi_slopes_ptr + heads, mask=offs_h < NUM_QUERIES_PER_KV, other=0.0)
        alibi_row += slopes * 1.4426950408889634  # log2(e): base-2 scores

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    if LEARNED_SINKS:
        # The learned sink enters partition 0 (always live) as a key of score sink_h and value 0:
        # m_i = sink_h, l_i = exp2(0) = 1, acc = 0. The reduce then counts it exactly once.
        head_mask = offs_h < NUM_QUERIES_PER_KV
        sink = tl.load(learned_sinks_ptr + heads, mask=head_mask, other=float("-inf")).to(tl.float32)
        m_i = tl.where(part == 0, sink * 1.4426950408889634, m_i)
        l_i = tl.where((part == 0) & head_mask, 1.0, l_i)
    # What every stage below shares (paged_tiles.attend_paged_range's tuples).
    state = (acc, l_i, m_i)
    keys = (key_cache_ptr + kv_head * stride_k_head, stride_k_block, stride_k_slot, k_dim_offs)
    values = (value_cache_ptr + kv_head * stride_v_head, stride_v_block, stride_v_slot, v_dim_offs)
    cache = (keys, values, (block_tables_ptr + seq * stride_bt_seq, stride_bt_blk))
    scores = (qk_scale, v_scale, sliding_window, soft_cap, alibi_row)
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
    # without per-token masks; then at most one tile cut by seq_len. Not causal: the query is the
    # context's last token.
    rows = (q, q_pos)
    state = attend_paged_range(state, rows, lo, head_end, window_start, cache, scores, CONFIG, MASK_TAIL=True)
    state = attend_paged_range(
        state, rows, head_end, full_end, head_end, cache, scores, CONFIG, MASK_TAIL=False
    )
    state = attend_paged_range(state, rows, full_end, end, full_end, cache, scores, CONFIG, MASK_TAIL=True)
    acc, l_i, m_i = state

    # A sequence whose context fits one partition (every one when num_partitions is 1; under a CUDA
    # graph captured for max_model_len, most of them) has nothing to merge: its only program
    # writes the output, and the reduce pass skips it.
    if tl.cdiv(seq_len - start, partition_size) == 1 and part == 0:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :] * stride_o_dim,
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )
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


@triton.jit(do_not_specialize=["partition_size", "sliding_window", *_WORKSPACE_STRIDES])
def _paged_decode_reduce_kernel(
    out_ptr,
    partial_out_ptr,
    max_logits_ptr,
    exp_sums_ptr,
    seq_lens_ptr,
    stride_o_seq,
    stride_o_head,
    stride_o_dim,
    stride_po_seq,
    stride_po_head,
    stride_po_part,
    stride_po_dim,
    stride_ml_seq,
    stride_ml_head,
    stride_ml_part,
    partition_size,
    sliding_window,
    HEAD_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    # Only the partitions kernel 1 wrote, [0, num_parts) from the window's first tile: the rest of
    # the workspace is uninitialized.
    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = _window_start(seq_len, sliding_window) // BLOCK_N * BLOCK_N
    num_parts = tl.cdiv(seq_len - first_key, partition_size)
    if num_parts == 1:  # kernel 1 wrote this sequence's output itself
        return
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, HEAD_DIM)
    ml_ptr = max_logits_ptr + seq * stride_ml_seq + head * stride_ml_head
    es_ptr = exp_sums_ptr + seq * stride_ml_seq + head * stride_ml_head
    po_ptr = partial_out_ptr + seq * stride_po_seq + head * stride_po_head

    running_max = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        parts = p0 + offs_p
        m = tl.load(ml_ptr + parts * stride_ml_part, mask=parts < num_parts, other=float("-inf"))
        running_max = tl.maximum(running_max, m)
    global_max = tl.max(running_max, 0)

    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    denom = tl.zeros([BLOCK_P], dtype=tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        parts = p0 + offs_p
        part_mask = parts < num_parts
        m = tl.load(ml_ptr + parts * stride_ml_part, mask=part_mask, other=float("-inf"))
        exp_sum = tl.load(es_ptr + parts * stride_ml_part, mask=part_mask, other=0.0)
        o = tl.load(
            po_ptr + parts[:, None] * stride_po_part + offs_d[None, :] * stride_po_dim,
            mask=part_mask[:, None],
            other=0.0,
        )
        weight = tl.exp2(m - global_max)  # 0 for the masked partitions
        denom += weight * exp_sum
        acc += tl.sum(weight[:, None] * o, 0)
    out = acc / tl.sum(denom, 0)
    tl.store(
        out_ptr + seq * stride_o_seq + head * stride_o_head + offs_d * stride_o_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_SIZE,
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
    """
    layout = check_paged_inputs(query, key_cache, value_cache, block_tables, seq_lens, out)
    kv_fp8, kv_scales = fp8_scale_args(query, key_cache, k_scale, v_scale)
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
    num_queries_per_kv = num_heads // num_kv_heads
    head_dim = triton.next_power_of_2(head_size)
    # A window's keys start within a tile of its first tile: it spans at most window + block_n - 1.
    attended_bound = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + block_n - 1)
    num_partitions = triton.cdiv(attended_bound, partition_size)
    single_partition = num_partitions == 1
    # float32 scratch for kernel 1's per-partition state; a [.., 1, ..] stub when it is unused.
    workspace_parts = 1 if single_partition else num_partitions
    partial_out = torch.empty(
        num_seqs, num_heads, workspace_parts, head_dim, dtype=torch.float32, device=query.device
    )
    max_logits = torch.empty(num_seqs, num_heads, workspace_parts, dtype=torch.float32, device=query.device)
    exp_sums = torch.empty_like(max_logits)

    _paged_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out,
        partial_out,
        max_logits,
        exp_sums,
        query,
        sink_query if streaming_sinks else query,  # a pointer never read without sinks
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query if alibi_slopes is None else alibi_slopes,  # a pointer never read without ALiBi
        query if sinks is None else sinks,  # a pointer never read without learned sinks
        *kv_scales,
        scale * math.log2(math.e),
        sliding_window or 0,
        attention_sinks,
        (logits_soft_cap or 0.0) * math.log2(math.e),
        *query.stride(),
        *(sink_query if streaming_sinks else query).stride(),
        *out.stride(),
        *partial_out.stride(),
        *max_logits.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_tables.stride(),
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        BLOCK_H=max(16, triton.next_power_of_2(num_queries_per_kv)),
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
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_options(query.device),
    )
    if not single_partition:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            out,
            partial_out,
            max_logits,
            exp_sums,
            seq_lens,
            *out.stride(),
            *partial_out.stride(),
            *max_logits.stride(),
            partition_size=partition_size,
            sliding_window=sliding_window or 0,
            HEAD_SIZE=head_size,
            HEAD_DIM=head_dim,
            BLOCK_N=block_n,
            # One tile width for any number of partitions: masked lanes cost nothing here, and a
            # width per count would compile a kernel per count.
            BLOCK_P=_REDUCE_BLOCK_P,
            **pdl_options(query.device),
        )
    return out
