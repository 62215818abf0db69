"""The second pass of paged decode (FlashDecoding, Dao et al. 2023): each query head's context
partitions merged into its output.

``paged_decode_reduce_kernel``, grid ``(num_seqs, num_heads)``: reads the live partitions of one
query head (``cdiv(seq_len - first tile's key, partition_size)`` of them, from the tile holding a
sliding window's first key; with one, ``paged_decode``'s kernel 1 wrote the output itself and the
program exits), rescales each by ``exp2(m_p - max_p m_p)`` and writes ``sum(w_p * acc_p) /
sum(w_p * l_p)``; with ``PARTIAL`` (context parallelism) also the row's log-sum-exp, ``max_p m_p
+ log2(sum w_p l_p)`` in base e. Local key counts under context parallelism as in kernel 1
(``paged_tiles.local_key_count``).

Layouts: out ``[num_seqs, num_heads, head_size]``, lse ``[num_seqs, num_heads]`` float32; the
float32 workspace partial_out ``[num_seqs, num_heads, num_partitions, HEAD_DIM]``,
max_logits/exp_sums ``[num_seqs, num_heads, num_partitions]``; seq_lens ``[num_seqs]`` int32.

Bound: ``num_partitions * (HEAD_DIM + 2) * 4`` bytes read per (sequence, head), under 1% of the
K/V bytes kernel 1 reads at partitions of 512 tokens; one launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedllm.kernels.triton.paged_tiles import local_key_count, row_lse, window_start_of
from pagedllm.kernels.triton.pdl import wait_for_prior_kernel

# Partitions per tile of the merge: one width for any number of partitions (masked lanes cost
# nothing here, and a width per count would compile a kernel per count).
REDUCE_BLOCK_P = 32

# The workspace's strides follow the number of partitions, which changes from step to step: Triton
# would otherwise compile a variant whenever one of them turns 1 or a multiple of 16.
WORKSPACE_STRIDES = ["stride_po_seq", "stride_po_head", "stride_ml_seq", "stride_ml_head"]


@triton.jit(do_not_specialize=["partition_size", "sliding_window", "cp_rank", *WORKSPACE_STRIDES])
def paged_decode_reduce_kernel(
    out_ptr,
    lse_ptr,  # written when PARTIAL
    partial_out_ptr,
    max_logits_ptr,
    exp_sums_ptr,
    seq_lens_ptr,
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
    stride_ml_part,
    partition_size,
    sliding_window,
    cp_rank,
    HEAD_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CP_SIZE: tl.constexpr,
    PARTIAL: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    # Only the partitions kernel 1 wrote, [0, num_parts) from the window's first tile: the rest of
    # the workspace is uninitialized.
    # (Kernel 1's local key indices: local_key_count.)
    global_len = tl.load(seq_lens_ptr + seq)
    seq_len = local_key_count(global_len, cp_rank, CP_SIZE)
    first_key = local_key_count(window_start_of(global_len, sliding_window), cp_rank, CP_SIZE)
    first_key = first_key // BLOCK_N * BLOCK_N
    num_parts = tl.cdiv(seq_len - first_key, partition_size)
    # Kernel 1 wrote this sequence's output itself: it had one partition, or (a partial decode) none
    # with a key the query sees (seq_len - first_key < BLOCK_N, so at most one).
    if num_parts <= 1:
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
    if PARTIAL:
        lse = row_lse(tl.sum(denom, 0), global_max)
        tl.store(lse_ptr + seq * stride_lse_seq + head * stride_lse_head, lse)
