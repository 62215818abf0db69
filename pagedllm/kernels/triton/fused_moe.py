"""Fused mixture-of-experts: two grouped GEMMs over the (token, slot) pairs sorted by expert.

Algorithm (the sorted, block-aligned formulation of vLLM's ``fused_moe`` and MegaBlocks, Gale et
al. 2022), for ``num_pairs = num_tokens * top_k`` routed pairs:

1. ``moe_align_block_size`` (on the device, no host sync: one program of ``_moe_align_kernel`` at
   decode sizes, torch ops past them): sort the pairs by expert
   and pad each expert's run to a multiple of ``BLOCK_M``, so that every ``BLOCK_M`` tile of the
   sorted list belongs to one expert. Padding entries hold ``num_pairs`` (masked everywhere).
   The buffers have a fixed size given ``num_pairs`` -- ``num_pairs + min(E, num_pairs) *
   (BLOCK_M - 1)`` rounded up to a tile -- so a decode step captures in a CUDA graph::

       topk_ids (flat)    2 0 2 1 0 2            (E = 3, BLOCK_M = 4)
       sorted_token_ids   1 4 . . | 3 . . . | 0 2 5 .      (. = padding)
       expert_ids         0       | 1       | 2

2. GEMM 1 (``GATED``): for each tile, ``act = silu(x @ gate_e^T) * (x @ up_e^T)``, with the gate
   and up columns of the tile in two accumulators over the same x tile, written to
   ``intermediate[pair]`` ([num_pairs, I]). The row of x is ``pair // top_k``.
3. GEMM 2: ``out[pair] = topk_weight[pair] * (intermediate[pair] @ down_e^T)`` ([num_pairs, H]).
4. ``out.view(num_tokens, top_k, H).sum(1)`` adds each token's slots (torch; deterministic, and
   small next to the weights).

Grid of each GEMM: one program per (``BLOCK_M`` tile of the sorted pairs, ``BLOCK_N`` output
columns), ordered in groups of ``GROUP_M`` tiles so that neighbouring programs share weight tiles
in L2; tiles past the padded end exit at once. Inputs to ``tl.dot`` are the model dtype, the
accumulators float32 (IEEE float32 products for float32 inputs, no TF32).

Layouts: hidden_states [num_tokens, H]; gate_up_proj [E, 2 * I, H] (gate rows then up rows);
down_proj [E, H, I]; any strides.

Bound: at decode sizes, memory: the weights of the experts the batch touches, ``3 * H * I *
element_size`` bytes each (about E * (1 - (1 - top_k / E) ** num_tokens) experts for uniform
routing). At prefill sizes, compute: ``6 * num_pairs * H * I`` FLOPs, plus the padding rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K,
    num_pairs,
    num_sorted,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    PAIRS_PER_ROW: tl.constexpr,  # top_k when a row of A is a token (GEMM 1), 1 when it is a pair
    GATED: tl.constexpr,  # B holds gate rows [0, N) and up rows [N, 2N): write silu(gate) * up
    MUL_ROUTED_WEIGHT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no TF32), None for 16-bit
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped order: GROUP_M consecutive tiles of sorted pairs sweep the N tiles together.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_sorted, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_token_ids_ptr + offs_m)
    row_mask = pairs < num_pairs
    a_rows = (pairs // PAIRS_PER_ROW).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_ROUTED_WEIGHT:
        weights = tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * weights[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class MoeLaunch:
    """Tile sizes and launch parameters of both GEMMs."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def default_launch(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeLaunch:
    """Tiles for H100/H200: at decode sizes (few pairs per expert) 16-row tiles waste the least
    padding and long K tiles keep enough weight bytes in flight; at prefill sizes 64x128 tiles
    reuse each loaded weight tile over 64 rows. K tiles shrink for float32 so that the
    ``num_stages`` buffers of x, gate and up tiles fit in shared memory."""
    scale = torch.finfo(dtype).bits // 16  # 1 for 16-bit, 2 for float32
    pairs_per_expert = num_pairs / num_experts
    if pairs_per_expert <= 16:
        return MoeLaunch(16, 64, 128 // scale, 1, 4, 3)
    if pairs_per_expert <= 48:
        return MoeLaunch(32, 64, 128 // scale, 4, 4, 3)
    return MoeLaunch(64, 128, 64 // scale, 8, 8, 3)


def max_num_sorted(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Length of the sorted, padded pair list: each expert that gets pairs pads at most
    ``block_m - 1`` entries, and at most ``min(num_experts, num_pairs)`` experts get any."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(padded, block_m) * block_m


@triton.jit
def _moe_align_kernel(
    topk_ids_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    num_pairs,
    num_experts,
    num_sorted,
    BLOCK_M: tl.constexpr,
    NUM_EXPERTS_P2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: count, pad, fill, and place each pair at its expert's start plus the number of
    earlier pairs of that expert (a one-hot [BLOCK, E] prefix sum per chunk): stable, as argsort."""
    experts = tl.arange(0, NUM_EXPERTS_P2)
    counts = tl.zeros([NUM_EXPERTS_P2], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_post_padded_ptr, tl.sum(padded, axis=0))
    for start in range(0, num_sorted // BLOCK_M, BLOCK):
        tiles = start + tl.arange(0, BLOCK)
        # The tile's expert: how many experts' runs end at or before its first row.
        ended = tl.sum((ends[None, :] <= tiles[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(
            expert_ids_ptr + tiles, tl.minimum(ended, num_experts - 1), mask=tiles < num_sorted // BLOCK_M
        )
    for start in range(0, num_sorted, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(
            sorted_token_ids_ptr + offs, tl.full([BLOCK], 0, tl.int32) + num_pairs, mask=offs < num_sorted
        )
    # The padding is written before the pairs land over it (other threads of this program).
    tl.debug_barrier()
    cursor = ends - padded
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1)
        one_hot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK, NUM_EXPERTS_P2]
        earlier = tl.cumsum(one_hot, axis=0) - one_hot
        slots = tl.sum((earlier + cursor[None, :]) * one_hot, axis=1)
        tl.store(sorted_token_ids_ptr + slots, offs, mask=offs < num_pairs)
        cursor += tl.sum(one_hot, axis=0)


# Up to this many pairs (decode sizes: 512 tokens at top-8) the sort-and-pad is one program of
# _moe_align_kernel; past it, a dozen torch ops (sort included) spread over the GPU are faster.
ALIGN_KERNEL_MAX_PAIRS = 4096


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the routed pairs by expert (stable), each expert's run padded to a multiple of ``block_m``.

    topk_ids: [num_tokens, top_k]. Returns ``sorted_token_ids`` [num_sorted] int32 (flattened pair
    indices, ``num_pairs`` for padding), ``expert_ids`` [num_sorted // block_m] int32 (the expert
    of each tile) and ``num_tokens_post_padded`` [1] int32 (where the tiles in use end), all on the
    device of topk_ids, computed without a host sync.
    """
    flat_ids = topk_ids.flatten()
    num_pairs = flat_ids.numel()
    num_sorted = max_num_sorted(num_pairs, num_experts, block_m)
    if num_pairs > ALIGN_KERNEL_MAX_PAIRS:
        return _align_torch(flat_ids, block_m, num_experts, num_sorted)
    device = flat_ids.device
    sorted_token_ids = torch.empty(num_sorted, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_sorted // block_m, dtype=torch.int32, device=device)
    num_post_padded = torch.empty(1, dtype=torch.int32, device=device)
    num_experts_p2 = triton.next_power_of_2(num_experts)
    # A [BLOCK, experts] one-hot of 8K elements: 32 registers a thread at 8 warps.
    block = max(16, min(256, 8192 // num_experts_p2))
    _moe_align_kernel[(1,)](
        flat_ids,
        sorted_token_ids,
        expert_ids,
        num_post_padded,
        num_pairs,
        num_experts,
        num_sorted,
        BLOCK_M=block_m,
        NUM_EXPERTS_P2=num_experts_p2,
        BLOCK=block,
        num_warps=8,
    )
    return sorted_token_ids, expert_ids, num_post_padded


def _align_torch(
    flat_ids: torch.Tensor, block_m: int, num_experts: int, num_sorted: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_align_block_size in torch ops, for large pair counts."""
    num_pairs = flat_ids.numel()
    device = flat_ids.device
    # scatter_add_, not bincount: bincount reads the maximum back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = torch.argsort(flat_ids, stable=True)
    sorted_experts = flat_ids[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    sorted_token_ids = torch.full((num_sorted,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids[(padded_ends - padded)[sorted_experts] + rank_in_expert] = order.to(torch.int32)
    tile_starts = torch.arange(0, num_sorted, block_m, device=device)
    # Tiles past the end get expert num_experts - 1; the kernel skips them before reading it.
    expert_ids = torch.searchsorted(padded_ends, tile_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_token_ids, expert_ids.to(torch.int32), padded_ends[-1:].to(torch.int32)


def fused_moe(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    launch: MoeLaunch | None = None,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, ``e = topk_ids[t, j]``.

    hidden_states: [num_tokens, H]; gate_up_proj: [E, 2 * I, H]; down_proj: [E, H, I];
    topk_weights: [num_tokens, top_k] float; topk_ids: [num_tokens, top_k] int.
    Returns [num_tokens, H] in the dtype of hidden_states.
    """
    num_tokens, hidden_size = hidden_states.shape
    num_experts, two_i, _ = gate_up_proj.shape
    intermediate = two_i // 2
    top_k = topk_ids.shape[1]
    assert gate_up_proj.shape == (num_experts, 2 * intermediate, hidden_size), tuple(gate_up_proj.shape)
    assert down_proj.shape == (num_experts, hidden_size, intermediate), tuple(down_proj.shape)
    assert topk_weights.shape == topk_ids.shape == (num_tokens, top_k)
    assert gate_up_proj.dtype == down_proj.dtype == hidden_states.dtype, "weights and activations differ"
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return hidden_states.new_zeros(num_tokens, hidden_size)
    launch = launch or default_launch(num_pairs, num_experts, hidden_states.dtype)
    sorted_token_ids, expert_ids, num_post_padded = moe_align_block_size(
        topk_ids, launch.block_m, num_experts
    )
    weights = topk_weights.contiguous()
    intermediate_out = hidden_states.new_empty(num_pairs, intermediate)
    _launch_gemm(
        hidden_states,
        gate_up_proj,
        intermediate_out,
        weights,
        sorted_token_ids,
        expert_ids,
        num_post_padded,
        top_k,
        True,
        launch,
    )
    out = hidden_states.new_empty(num_pairs, hidden_size)
    _launch_gemm(
        intermediate_out,
        down_proj,
        out,
        weights,
        sorted_token_ids,
        expert_ids,
        num_post_padded,
        1,
        False,
        launch,
    )
    return out.view(num_tokens, top_k, hidden_size).sum(dim=1)


def _launch_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_post_padded: torch.Tensor,
    pairs_per_row: int,
    gated: bool,
    launch: MoeLaunch,
) -> None:
    """One grouped GEMM: ``c[pair] = a[pair // pairs_per_row] @ b[expert]^T``, then silu(gate) * up
    when ``gated``, else times the pair's routing weight."""
    n = c.shape[1]
    num_sorted = sorted_token_ids.numel()
    grid = (triton.cdiv(num_sorted, launch.block_m) * triton.cdiv(n, launch.block_n),)
    _moe_gemm_kernel[grid](
        a,
        b,
        c,
        topk_weights,
        sorted_token_ids,
        expert_ids,
        num_post_padded,
        n,
        a.shape[1],
        c.shape[0],
        num_sorted,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        c.stride(1),
        PAIRS_PER_ROW=pairs_per_row,
        GATED=gated,
        MUL_ROUTED_WEIGHT=not gated,
        INPUT_PRECISION="ieee" if a.dtype == torch.float32 else None,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        GROUP_M=launch.group_m,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
