"""Paged decode attention for multi-head latent attention (MLA, DeepSeek-V2/V3), absorbed form.

Algorithm: in the absorbed form (DeepSeek-V2 s. 2.1.2; vLLM's MLA backends) the up-projections
fold into the query and the output, so each head's score against token k is
``q_latent_h . c_k + q_pe_h . k_pe_k`` and its output ``sum_k p_hk c_k`` (``r = kv_lora_rank``
dims, mapped back by W_UV after this kernel). Every head reads the same cached entry ``[c_kv |
k_pe]`` per token: attention is MQA with one "head" of ``r + rope`` (576 for DeepSeek-V2/V3) that
is both key (all of it) and value (its first ``r`` dims). The context is split as in FlashDecoding
(Dao et al. 2023): each partition leaves its log2-unit running max ``m_i``, sum ``l_i`` and
unnormalized ``acc`` per head, and a second kernel merges them.

Kernel 1, ``_mla_decode_kernel``, grid ``(cdiv(num_heads, BLOCK_H), num_seqs, num_partitions)``:
  a program takes ``BLOCK_H`` heads of one sequence (the rows of its dots, >= 16 for the tensor
  cores) and one partition of its context. Per tile of ``BLOCK_N`` tokens it reads the block
  numbers, then the tile's latents ``[BLOCK_N, r]`` and rope keys ``[BLOCK_N, rope]`` once for all
  its heads; ``s = q_latent c^T + q_pe k_pe^T`` (two dots into one ``[BLOCK_H, BLOCK_N]``), an
  online-softmax update, and ``acc += p c`` reusing the latent tile as the values. A sequence whose
  context fits one partition gets ``acc / l_i`` written to the output directly.
Kernel 2, ``_mla_merge_kernel``, grid ``(cdiv(num_heads, BLOCK_H), num_seqs)``, launched only when
  some sequence may span several partitions: a program folds its heads' partitions one at a time
  into a running ``(m, l, acc)`` (the online softmax's rescaling, over partitions), reading each
  partition's ``[BLOCK_H, r]`` rows contiguous, and writes ``acc / l``; a sequence of one
  partition (kernel 1 wrote it) exits at once.

``num_partitions`` comes from the host bound ``max_seq_len`` (``max_model_len`` under CUDA
graphs), never from the device's ``seq_lens``: no host sync, and a captured graph stays valid for
every replay (programs past a sequence's end exit at once).

Layouts: q_latent/out ``[num_seqs, num_heads, r]`` and q_pe ``[num_seqs, num_heads, rope]``, any
strides (views of batched matmuls' outputs); cache ``[num_blocks, block_size, r + rope]`` with the
last dim contiguous (the torch layout ``[.., block_size, 1, ..]`` and the Triton layout ``[.., 1,
block_size, ..]`` of one KV head are both this in memory); block_tables ``[num_seqs, max_blocks]``
int32; seq_lens ``[num_seqs]`` int32; workspace (float32) partials ``[num_seqs, num_partitions,
num_heads, r]`` and stats ``[num_seqs, num_partitions, num_heads, 2]`` (``m_i``, ``l_i``).

Bound: memory. Bytes ~ ``sum(seq_lens) * (r + rope) * element_size * cdiv(num_heads, BLOCK_H)``
(each latent read once per head block: once for DeepSeek-V2-Lite's 16 heads, 8x for V3's 128 at
BLOCK_H = 16); FLOPs ~ ``2 * sum(seq_lens) * num_heads * (2 r + rope)``: 128 heads make ~2 * 128 *
1,088 / 1,152 ~ 240 FLOPs per byte at 16 bits over one read, near an H100's ridge point, which is
why heads share a tile instead of each re-reading it. Workspace traffic ``num_partitions *
num_heads * r * 4`` bytes per sequence, written by kernel 1 and read by kernel 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.launch import decode_partition_size
from pagedllm.kernels.triton.paged_tiles import dot_precision
from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel

# Heads per program: the tensor cores' minimum row count, and DeepSeek-V2-Lite's heads per rank.
MLA_BLOCK_H = 16
# Tokens per partition: at most MLA_PARTITION_SIZE, at least MLA_MIN_PARTITION when
# decode_partition_size splits finer to fill the GPU. A partition's float32 partials are r * 4 =
# 2 KiB per head, written then read again by kernel 2: 32 KiB for 16 heads against 288 KiB of
# latents read over 256 tokens (11%), where 64-token partitions would add 44%.
MLA_PARTITION_SIZE = 1024
MLA_MIN_PARTITION = 256


@dataclass(frozen=True)
class MLALaunch:
    """Launch parameters of ``mla_decode``: latent tokens per tile, warps, pipeline stages. Triton
    does not multi-buffer this loop (its tile feeds two dots): compiled for sm_90 it takes the same
    shared memory at 1, 2 or 3 stages, 58 KiB at the 16-bit default, so latency hides behind the
    programs an SM holds at once (``bench mla --sweep`` times the alternatives). Float32 (the
    tests' dtype, exact dots on FMA units) takes half the tile and twice the warps."""

    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def default(cls, dtype: torch.dtype) -> MLALaunch:
        return cls(block_n=16, num_warps=8) if dtype == torch.float32 else cls()


# The workspace's strides follow the number of partitions, which changes from launch to launch.
_WORKSPACE_STRIDES = ["stride_w_seq", "stride_w_part", "stride_s_seq", "stride_s_part"]


@triton.jit(do_not_specialize=["partition_size", *_WORKSPACE_STRIDES])
def _mla_decode_kernel(
    out_ptr,
    partials_ptr,
    stats_ptr,
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
    stride_w_seq,  # partials (heads r apart, dims contiguous)
    stride_w_part,
    stride_s_seq,  # stats (heads 2 apart)
    stride_s_part,
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
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    seq, part = tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * partition_size
    if start >= seq_len:
        return
    end = tl.minimum(start + partition_size, seq_len)
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

    if tl.cdiv(seq_len, partition_size) == 1:  # the whole context: the output itself
        out = acc / l_i[:, None]
        out_rows = out_ptr + seq * stride_o_seq + heads * stride_o_head
        tl.store(
            out_rows[:, None] + offs_r[None, :], out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None]
        )
    else:  # this partition's state, for kernel 2
        rows = seq * stride_w_seq + part * stride_w_part + heads * LORA_RANK
        tl.store(partials_ptr + rows[:, None] + offs_r[None, :], acc, mask=head_mask[:, None])
        stats = stats_ptr + seq * stride_s_seq + part * stride_s_part + heads * 2
        tl.store(stats[:, None] + tl.arange(0, 2)[None, :], tl.join(m_i, l_i), mask=head_mask[:, None])


@triton.jit(do_not_specialize=["partition_size", *_WORKSPACE_STRIDES])
def _mla_merge_kernel(
    out_ptr,
    partials_ptr,
    stats_ptr,
    seq_lens_ptr,
    partition_size,
    num_heads,
    stride_o_seq,
    stride_o_head,
    stride_w_seq,
    stride_w_part,
    stride_s_seq,
    stride_s_part,
    LORA_RANK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    seq = tl.program_id(1)
    # Only the partitions kernel 1 wrote: the rest of the workspace is uninitialized.
    num_parts = tl.cdiv(tl.load(seq_lens_ptr + seq), partition_size)
    if num_parts == 1:
        return
    head_mask = heads < num_heads
    offs_r = tl.arange(0, LORA_RANK)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)  # noqa: E741 (the paper's name)
    acc = tl.zeros([BLOCK_H, LORA_RANK], dtype=tl.float32)
    for part in range(num_parts):
        # Every partition below num_parts holds a key, so each m_p is finite.
        stats = stats_ptr + seq * stride_s_seq + part * stride_s_part + heads * 2
        m_p = tl.load(stats, mask=head_mask, other=0.0)
        l_p = tl.load(stats + 1, mask=head_mask, other=1.0)  # (padding rows: no 0 / 0)
        rows = seq * stride_w_seq + part * stride_w_part + heads * LORA_RANK
        acc_p = tl.load(partials_ptr + rows[:, None] + offs_r[None, :], mask=head_mask[:, None], other=0.0)
        m_new = tl.maximum(m, m_p)
        alpha, beta = tl.exp2(m - m_new), tl.exp2(m_p - m_new)
        acc = acc * alpha[:, None] + acc_p * beta[:, None]
        l = l * alpha + l_p * beta  # noqa: E741
        m = m_new
    out_rows = out_ptr + seq * stride_o_seq + heads * stride_o_head
    out = (acc / l[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_rows[:, None] + offs_r[None, :], out, mask=head_mask[:, None])


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
    # float32 scratch for the partitions' state (unread with one partition: kernel 1 writes the output).
    partials = torch.empty(
        num_seqs, num_partitions, num_heads, lora_rank, dtype=torch.float32, device=out.device
    )
    stats = torch.empty(num_seqs, num_partitions, num_heads, 2, dtype=torch.float32, device=out.device)
    workspace_strides = (partials.stride(0), partials.stride(1), stats.stride(0), stats.stride(1))
    _mla_decode_kernel[(num_head_blocks, num_seqs, num_partitions)](
        out,
        partials,
        stats,
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
        *workspace_strides,
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
        _mla_merge_kernel[(num_head_blocks, num_seqs)](
            out,
            partials,
            stats,
            seq_lens,
            partition_size,
            num_heads,
            out.stride(0),
            out.stride(1),
            *workspace_strides,
            LORA_RANK=lora_rank,
            BLOCK_H=MLA_BLOCK_H,
            # Two [BLOCK_H, r] float32 tiles in registers (the running and the read partition).
            num_warps=8,
            **pdl_options(out.device),
        )
    return out
