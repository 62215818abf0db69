"""Paged decode attention for multi-head latent attention (MLA, DeepSeek-V2/V3), absorbed form.

Algorithm: in the absorbed form (DeepSeek-V2 s. 2.1.2; vLLM's MLA backends) the up-projections
fold into the query and the output, so each head's score against token k is
``q_latent_h . c_k + q_pe_h . k_pe_k`` and its output ``sum_k p_hk c_k`` (``r = kv_lora_rank``
dims, mapped back by W_UV after this kernel). Every head reads the same cached entry ``[c_kv |
k_pe]`` per token: attention is MQA with one "head" of ``r + rope`` (576 for DeepSeek-V2/V3) that
is both key (all of it) and value (its first ``r`` dims). The context is split as in FlashDecoding
(Dao et al. 2023) and merged by ``paged_decode``'s reduce kernel, which this kernel's partials
match: log2-unit running max ``m_i``, sum ``l_i`` and unnormalized ``acc`` per head and partition.

Kernel 1, ``_mla_decode_kernel``, grid ``(cdiv(num_heads, BLOCK_H), num_seqs, num_partitions)``:
  a program takes ``BLOCK_H`` heads of one sequence (the rows of its dots, >= 16 for the tensor
  cores) and one partition of its context. Per tile of ``BLOCK_N`` tokens it reads the block
  numbers, then the tile's latents ``[BLOCK_N, r]`` and rope keys ``[BLOCK_N, rope]`` once for all
  its heads; ``s = q_latent c^T + q_pe k_pe^T`` (two dots into one ``[BLOCK_H, BLOCK_N]``), an
  online-softmax update, and ``acc += p c`` reusing the latent tile as the values. A sequence whose
  context fits one partition gets ``acc / l_i`` written to the output directly.
Kernel 2: ``paged_decode``'s reduce (``reduce_partitions``, grid ``(num_seqs, num_heads)``), launched
  only when some launch spans several partitions; it skips single-partition sequences.

``num_partitions`` comes from the host bound ``max_seq_len`` (``max_model_len`` under CUDA
graphs), never from the device's ``seq_lens``: no host sync, and a captured graph stays valid for
every replay (programs past a sequence's end exit at once).

Layouts: q_latent/out ``[num_seqs, num_heads, r]`` and q_pe ``[num_seqs, num_heads, rope]``, any
strides (views of batched matmuls' outputs); cache ``[num_blocks, block_size, r + rope]`` with the
last dim contiguous (the torch layout ``[.., block_size, 1, ..]`` and the Triton layout ``[.., 1,
block_size, ..]`` of one KV head are both this in memory); block_tables ``[num_seqs, max_blocks]``
int32; seq_lens ``[num_seqs]`` int32; workspace (float32) partial_out ``[num_seqs, num_heads,
num_partitions, r]``, max_logits/exp_sums ``[num_seqs, num_heads, num_partitions]``.

Bound: memory. Bytes ~ ``sum(seq_lens) * (r + rope) * element_size * cdiv(num_heads, BLOCK_H)``
(each latent read once per head block: once for DeepSeek-V2-Lite's 16 heads, 8x for V3's 128 at
BLOCK_H = 16); FLOPs ~ ``2 * sum(seq_lens) * num_heads * (2 r + rope)``: 128 heads make ~2 * 128 *
1,088 / 1,152 ~ 240 FLOPs per byte at 16 bits over one read, near an H100's ridge point, which is
why heads share a tile instead of each re-reading it. Workspace traffic ``num_partitions *
num_heads * r * 4`` bytes per sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.launch import decode_partition_size
from pagedllm.kernels.triton.paged_decode import (
    _WORKSPACE_STRIDES,
    partition_workspace,
    reduce_partitions,
    write_partition,
)
from pagedllm.kernels.triton.paged_tiles import dot_precision
from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel

# Heads per program: the tensor cores' minimum row count, and DeepSeek-V2-Lite's heads per rank.
MLA_BLOCK_H = 16
# Tokens per partition: at most MLA_PARTITION_SIZE, at least MLA_MIN_PARTITION when
# decode_partition_size splits finer to fill the GPU. A partition's float32 partials are r * 4 =
# 2 KiB per head, written then read again by the reduce: 32 KiB for 16 heads against 288 KiB of
# latents read over 256 tokens (11%), where 64-token partitions would add 44%.
MLA_PARTITION_SIZE = 1024
MLA_MIN_PARTITION = 256


@dataclass(frozen=True)
class MLALaunch:
    """Launch parameters of ``mla_decode``: latent tokens per tile, warps, pipeline stages. A
    16-bit [32, 576] tile is 36 KiB of shared memory per stage; float32 (the tests' dtype, exact
    dots on FMA units) takes half the tile and twice the warps for its registers."""

    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def default(cls, dtype: torch.dtype) -> MLALaunch:
        return cls(block_n=16, num_warps=8) if dtype == torch.float32 else cls()


@triton.jit(do_not_specialize=["partition_size", *_WORKSPACE_STRIDES])
def _mla_decode_kernel(
    out_ptr,
    partial_out_ptr,
    max_logits_ptr,
    exp_sums_ptr,
    q_latent_ptr,
    q_pe_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e): scores in log2 units
    partition_size,
    num_heads,
    stride_ql_seq,
    stride_ql_head,
    stride_qp_seq,
    stride_qp_head,
    stride_o_seq,
    stride_o_head,
    stride_po_seq,
    stride_po_head,
    stride_po_part,
    stride_ml_seq,
    stride_ml_head,
    stride_ml_part,  # shared by max_logits and exp_sums
    stride_c_block,
    stride_c_slot,
    stride_bt_seq,
    LORA_RANK: tl.constexpr,  # r: a power of two >= 16 (512 in DeepSeek-V2/V3)
    ROPE_DIM: tl.constexpr,  # 64 in DeepSeek-V2/V3
    ROPE_PAD: tl.constexpr,  # ROPE_DIM up to a power of two >= 16 (a dot's minimum depth)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    # Head blocks vary fastest: those of one sequence and partition run together and share its
    # latent tiles in L2 (128 heads: 8 blocks reading the same bytes).
    head_block = tl.program_id(0)
    seq = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * partition_size
    if start >= seq_len:
        return
    end = tl.minimum(start + partition_size, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    offs_r = tl.arange(0, LORA_RANK)
    offs_p = tl.arange(0, ROPE_PAD)
    rope_mask = offs_p < ROPE_DIM
    offs_n = tl.arange(0, BLOCK_N)
    cache_ty = cache_ptr.dtype.element_ty
    q_latent = tl.load(
        q_latent_ptr + seq * stride_ql_seq + heads[:, None] * stride_ql_head + offs_r[None, :],
        mask=head_mask[:, None],
        other=0.0,
    ).to(cache_ty)
    q_pe = tl.load(
        q_pe_ptr + seq * stride_qp_seq + heads[:, None] * stride_qp_head + offs_p[None, :],
        mask=head_mask[:, None] & rope_mask[None, :],
        other=0.0,
    ).to(cache_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, LORA_RANK], dtype=tl.float32)
    block_table = block_tables_ptr + seq * stride_bt_seq
    for tile in range(start, end, BLOCK_N):
        tokens = tile + offs_n
        live = tokens < end
        # One block number per token: any block size, tiles may straddle blocks.
        blocks = tl.load(block_table + tokens // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        rows = cache_ptr + blocks * stride_c_block + (tokens % BLOCK_SIZE) * stride_c_slot
        latent = tl.load(rows[:, None] + offs_r[None, :], mask=live[:, None], other=0.0)
        k_pe = tl.load(
            rows[:, None] + LORA_RANK + offs_p[None, :], mask=live[:, None] & rope_mask[None, :], other=0.0
        )
        s = tl.dot(q_latent, tl.trans(latent), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=DOT_PRECISION)
        s = tl.where(live[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(cache_ty), latent, acc=acc, input_precision=DOT_PRECISION)
        m_i = m_new

    # A context of one partition is written out whole; others leave partials for the reduce.
    heads_out = out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head
    state_offs = seq * stride_ml_seq + heads * stride_ml_head + part * stride_ml_part
    partial_rows = partial_out_ptr + seq * stride_po_seq + heads * stride_po_head + part * stride_po_part
    partials = (
        partial_rows[:, None] + offs_r[None, :],
        max_logits_ptr + state_offs,
        exp_sums_ptr + state_offs,
    )
    whole = (heads_out + offs_r[None, :], head_mask[:, None])
    write_partition((acc, l_i, m_i), tl.cdiv(seq_len, partition_size) == 1, whole, partials, head_mask)


def check_mla_dims(kv_lora_rank: int) -> None:
    """ValueError for a latent the kernel cannot tile: its r dims are one tile of a power of two,
    at least a dot's depth of 16 (any rope dims are padded)."""
    if kv_lora_rank < 16 or triton.next_power_of_2(kv_lora_rank) != kv_lora_rank:
        raise ValueError(
            f"kv_lora_rank must be a power of two >= 16 for the Triton MLA decode kernel, got {kv_lora_rank}"
        )


def mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor,
    *,
    min_seq_len: int = 0,
    partition_size: int | None = None,
    launch: MLALaunch | None = None,
) -> torch.Tensor:
    """Each sequence's single query, absorbed, over its paged latents; writes ``out``.

    q_latent, out: [num_seqs, num_heads, r] (r = kv_lora_rank; last dim contiguous); q_pe:
    [num_seqs, num_heads, rope]; cache: [num_blocks, block_size, r + rope]; block_tables:
    [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32, each in [1, max_seq_len].
    ``max_seq_len`` is a host bound (max_model_len under CUDA graphs) that sets the number of
    partitions; ``min_seq_len`` (0: unknown) lets ``decode_partition_size`` leave equal contexts
    unsplit; ``partition_size`` overrides that choice (tests), ``launch`` the tiles and warps
    (``MLALaunch.default`` for the cache's dtype). ``scale`` multiplies the scores.
    """
    num_seqs, num_heads, lora_rank = q_latent.shape
    rope_dim = q_pe.shape[2]
    assert q_pe.shape[:2] == (num_seqs, num_heads) and out.shape == q_latent.shape, (
        f"q_latent {tuple(q_latent.shape)}, q_pe {tuple(q_pe.shape)}, out {tuple(out.shape)}"
    )
    assert cache.dim() == 3 and cache.shape[2] == lora_rank + rope_dim, (
        f"cache {tuple(cache.shape)} does not hold latents of {lora_rank} + {rope_dim}"
    )
    assert all(t.stride(-1) == 1 for t in (q_latent, q_pe, out, cache)), "last dims must be contiguous"
    assert block_tables.dtype == seq_lens.dtype == torch.int32, "int32 block_tables and seq_lens"
    assert block_tables.shape[0] == seq_lens.shape[0] == num_seqs, "one query per sequence"
    check_mla_dims(lora_rank)
    if num_seqs == 0:
        return out
    num_head_blocks = triton.cdiv(num_heads, MLA_BLOCK_H)
    if partition_size is None:
        bounds = {"partition_size": MLA_PARTITION_SIZE, "block_n": MLA_MIN_PARTITION}
        partition_size = decode_partition_size(
            num_seqs, num_head_blocks, max_seq_len, bounds, q_latent.device, min_seq_len
        )
    launch = launch or MLALaunch.default(cache.dtype)
    block_n = launch.block_n
    assert partition_size % block_n == 0, f"partition_size {partition_size} not a multiple of {block_n}"
    num_partitions = triton.cdiv(max_seq_len, partition_size)
    workspace = partition_workspace(num_seqs, num_heads, num_partitions, lora_rank, out.device)
    partial_out, max_logits, exp_sums = workspace
    _mla_decode_kernel[(num_head_blocks, num_seqs, num_partitions)](
        out,
        partial_out,
        max_logits,
        exp_sums,
        q_latent,
        q_pe,
        cache,
        block_tables,
        seq_lens,
        scale * math.log2(math.e),
        partition_size,
        num_heads,
        q_latent.stride(0),
        q_latent.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        out.stride(0),
        out.stride(1),
        *partial_out.stride()[:3],
        *max_logits.stride(),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        LORA_RANK=lora_rank,
        ROPE_DIM=rope_dim,
        ROPE_PAD=max(16, triton.next_power_of_2(rope_dim)),
        BLOCK_SIZE=cache.shape[1],
        BLOCK_H=MLA_BLOCK_H,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(cache.dtype == torch.float32),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **pdl_options(out.device),
    )
    if num_partitions > 1:
        reduce_partitions(out, workspace, seq_lens, partition_size, lora_rank, block_n)
    return out
