"""Fused mixture-of-experts: two grouped GEMMs over the (token, slot) pairs sorted by expert.

Algorithm (the sorted, block-aligned formulation of vLLM's ``fused_moe`` and MegaBlocks, Gale et
al. 2022), for ``num_pairs = num_tokens * top_k`` routed pairs:

1. ``moe_align_block_size`` (``moe_align.py``, on the device, no host sync): group the pairs by
   expert and pad each expert's run to a multiple of ``BLOCK_M``, so that every ``BLOCK_M`` tile
   of the sorted list belongs to one expert. Padding entries hold ``num_pairs`` (masked
   everywhere). The buffers have a fixed size given ``num_pairs``, so a decode step captures in a
   CUDA graph.

2. GEMM 1 (``GATED``): for each tile, ``act = silu(x @ gate_e^T) * (x @ up_e^T)``, with the gate
   and up columns of the tile in two accumulators over the same x tile, written to
   ``intermediate[pair]`` ([num_pairs, I]). The row of x is ``pair // top_k``.
3. GEMM 2: ``out[pair] = topk_weight[pair] * (intermediate[pair] @ down_e^T)`` ([num_pairs, H]).
4. ``moe_sum``: each token's slots added in slot order in float32, plus, when given, a shared
   expert's output scaled by ``sigmoid(its gate logit)`` (Qwen2-MoE, Qwen3-Next), rounded once
   (header at the function).

Grid of each GEMM: one program per (``BLOCK_M`` tile of the sorted pairs, ``BLOCK_N`` output
columns), ordered in groups of ``GROUP_M`` tiles so that neighbouring programs share weight tiles
in L2; tiles past the padded end exit at once. Inputs to ``tl.dot`` are the model dtype, the
accumulators float32 (IEEE float32 products for float32 inputs, no TF32).

The rows of x (or of the intermediate) a tile reads are gathered through the sorted pairs; the
weight tile is a plain ``[BLOCK_N, BLOCK_K]`` box of its expert's matrix, which on Hopper the TMA
copies by descriptor (``WEIGHTS_TMA``: 16-bit weights, the experts' matrices one ``[E * rows, K]``
matrix): the same values in the same order as the pointer loads, with fewer instructions for the
warps that issue the MMAs. W6's MoE layer on an H200 (17 experts of width 512 with the shared
expert absorbed, 9 slots), timed in CUDA graphs: at a 16,384-token prefill, gate_up 1,004 us
against 1,078 and down 637 against 751 (the down GEMM on 4 warps in both); at a 256-token decode
step 28.4 and 19.6 us against 30.8 and 20.6 (``pagedllm bench moe`` times Qwen3-30B-A3B's layer).

Layouts: hidden_states [num_tokens, H]; gate_up_proj [E, 2 * I, H] (gate rows then up rows);
down_proj [E, H, I]; any strides.

Bound: at decode sizes, memory: the weights of the experts the batch touches, ``3 * H * I *
element_size`` bytes each (about E * (1 - (1 - top_k / E) ** num_tokens) experts for uniform
routing). At prefill sizes, compute: ``6 * num_pairs * H * I`` FLOPs, plus the padding rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.moe_align import moe_align_block_size
from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel
from pagedllm.platform import platform_for


# The pair counts change every step: specialising on their divisibility would compile mid-run.
@triton.jit(do_not_specialize=["num_pairs", "num_sorted"])
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
    WEIGHTS_TMA: tl.constexpr,  # b_ptr is a descriptor over [E * rows, K] with [BLOCK_N, BLOCK_K] boxes
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
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
    if WEIGHTS_TMA:
        # The box's first row in the [E * rows, K] view. Past N it reads the next rows of the same
        # matrix (the up rows, the next expert's) or zeros past the end: only columns < N are stored.
        b_row = expert.to(tl.int32) * (stride_be // stride_bn) + pid_n * BLOCK_N  # TMA takes int32
    else:
        b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if WEIGHTS_TMA:  # zeros past K
            b = b_ptr.load([b_row, k * BLOCK_K]).T
        else:
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        if GATED:
            if WEIGHTS_TMA:
                b_up = b_ptr.load([b_row + N, k * BLOCK_K]).T
            else:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        if not WEIGHTS_TMA:
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
    """Tile sizes and launch parameters of both GEMMs. ``gate_up_block_n``: the gated GEMM's
    columns per tile where they differ from the down GEMM's (0: ``block_n``); its tile computes
    gate and up, twice the products of the down GEMM's per column. ``down_num_warps``: the down
    GEMM's warps where they differ (0: ``num_warps``)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    gate_up_block_n: int = 0
    down_num_warps: int = 0


def default_launch(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeLaunch:
    """Tiles for H100/H200, from ``pagedllm bench moe --sweep`` on an H200 (Qwen3-30B-A3B's layer).

    At decode sizes the weights of the touched experts are the bound: 16-row tiles waste the least
    padding while experts get a few pairs each (64 tokens at top-8 of 128: 4), 32-row tiles read
    each expert's weights once when they get a dozen or more (256 tokens: 16 on average, 0.31 ms
    for both GEMMs against 0.33 with 16-row tiles), and long K tiles keep weight bytes in flight.
    At prefill sizes (hundreds of pairs per expert) 128 x 128 tiles on 8 warps reuse each weight
    tile over 128 rows: 1.47 ms at 8,192 tokens against 1.71 with the best 64-row tiles. K tiles shrink
    for float32 so that the ``num_stages`` buffers of x, gate and up tiles fit in shared memory.
    """
    scale = torch.finfo(dtype).bits // 16  # 1 for 16-bit, 2 for float32
    pairs_per_expert = num_pairs / num_experts
    launch = next(launch for fewest, launch in reversed(_TIERS) if pairs_per_expert >= fewest)
    return replace(launch, block_k=launch.block_k // scale)


# default_launch's tiers, smallest first: (the fewest pairs per expert that take it, its tiles in
# 16 bits). warm_up compiles each.
# The 64-row tier's gated GEMM takes 64 columns: at W6's decode step (256 tokens, 16 experts of
# width 512, hidden 2048, top-8: 128 pairs per expert), timed in CUDA graphs on an H200 with the
# weights out of L2, 30.0 us against 46.0 with 128 (the down GEMM: 19.9 us with 128, 23.9 with 64).
# The 128-row tier's down GEMM (K = 512 there: eight K tiles per output tile) runs on 4 warps: at
# W6's 16,384-token prefill, 637 us against 719 on 8 (weights by TMA; 751 against 798 without).
_TIERS = (
    (0, MoeLaunch(16, 64, 128, 1, 4, 3)),
    (12, MoeLaunch(32, 64, 128, 16, 4, 3)),
    (49, MoeLaunch(64, 128, 64, 16, 4, 3, gate_up_block_n=64)),
    (192, MoeLaunch(128, 128, 64, 16, 8, 3, down_num_warps=4)),
)


def invariant_launch(dtype: torch.dtype) -> MoeLaunch:
    """``batch_invariant=True``'s one launch for every batch. Each output element sums its K in
    ``BLOCK_K`` tiles, in order, with no split, whichever tile of pairs it falls in; what could move
    its bits with the batch is the tile choice of ``default_launch``: its BLOCK_K, and its row
    count, since Triton runs tiles of 16 and 32 rows on the m16n8k16 MMA and tiles of 64 rows and
    more on Hopper's wgmma, whose sums differ in the last bit (measured on the attention kernel's
    tiles; docs/determinism.md). So one tile for every batch: 32 rows (a decode's experts get a few
    pairs each; a prefill's tiles read each weight tile for 32 rows) and ``default_launch``'s
    decode K tiles."""
    scale = torch.finfo(dtype).bits // 16
    return MoeLaunch(32, 64, 128 // scale, 16, 4, 3)


def warm_up(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, top_k: int, max_num_tokens: int) -> None:
    """Compile every launch ``default_launch`` can choose for these weights in a step of at most
    ``max_num_tokens`` tokens, before the first request: the profile run compiles the largest
    step's tiles and the CUDA graphs' capture the decode tiles, but a prefill of a few hundred to
    a few thousand tokens takes the tiles between, which would otherwise compile inside a step
    (about half a second each on an H200, for each GEMM). Peak memory stays under the profile
    run's, which ran ``max_num_tokens``."""
    num_experts, _, hidden_size = gate_up_proj.shape
    device, dtype = gate_up_proj.device, gate_up_proj.dtype
    for fewest, _ in _TIERS:
        num_tokens = triton.cdiv(max(fewest, 1) * num_experts, top_k)
        if num_tokens > max_num_tokens:
            break
        hidden_states = torch.zeros(num_tokens, hidden_size, device=device, dtype=dtype)
        # Every token on experts 0..top_k-1 by turns: the launch depends on the pair count alone.
        topk_ids = (torch.arange(num_tokens * top_k, device=device) % num_experts).view(num_tokens, top_k)
        topk_weights = torch.full((num_tokens, top_k), 1.0 / top_k, device=device)
        fused_moe(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids)


def fused_moe(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    launch: MoeLaunch | None = None,
    batch_invariant: bool = False,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, ``e = topk_ids[t, j]``,
    plus ``sigmoid(shared_gate[t]) * shared[t]`` when a shared expert's term is given.

    hidden_states: [num_tokens, H]; gate_up_proj: [E, 2 * I, H]; down_proj: [E, H, I];
    topk_weights: [num_tokens, top_k] float; topk_ids: [num_tokens, top_k] int; shared:
    [num_tokens, H] in the dtype of hidden_states and shared_gate: [num_tokens, 1] (logits), or
    both None. ``batch_invariant``: a token's output the same bits whatever else the batch holds
    (``invariant_launch``; the slots are always added in slot order, ``moe_sum``). Returns
    [num_tokens, H] in the dtype of hidden_states.
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
    if launch is None:
        dtype = hidden_states.dtype
        launch = invariant_launch(dtype) if batch_invariant else default_launch(num_pairs, num_experts, dtype)
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
    return moe_sum(out.view(num_tokens, top_k, hidden_size), shared, shared_gate)


@triton.jit
def _moe_sum_kernel(
    out_ptr,
    slots_ptr,
    shared_ptr,
    shared_gate_ptr,
    hidden_size,
    stride_slots_t,
    stride_slots_k,
    stride_shared_t,
    stride_gate_t,
    stride_out_t,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden_size
    slot_ptrs = slots_ptr + token * stride_slots_t + offs
    # ((s0 + s1) + s2) + ...: the unrolled loop issues every slot's load before the adds.
    total = tl.load(slot_ptrs, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOP_K):
        total += tl.load(slot_ptrs + j * stride_slots_k, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHARED:
        gate = tl.load(shared_gate_ptr + token * stride_gate_t).to(tl.float32)
        shared = tl.load(shared_ptr + token * stride_shared_t + offs, mask=mask, other=0.0).to(tl.float32)
        total += shared * (1.0 / (1.0 + tl.exp(-gate)))
    tl.store(out_ptr + token * stride_out_t + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum(
    slots: torch.Tensor, shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None
) -> torch.Tensor:
    """The MoE's combine: ``sum_j slots[t, j] + sigmoid(shared_gate[t]) * shared[t]`` -> [T, H].

    Algorithm, per output element, in float32 and rounded once to the dtype of slots::

        total = ((s0 + s1) + s2) + ... + s_{top_k - 1}          # slot order
        total += sigmoid(g) * shared                            # when a shared expert is given

    The order is fixed by the slot index alone, so a token's output is the same bits whatever
    its batch (the batch-invariant path needs nothing else), unlike torch's ``slots.sum(1)``,
    whose threads split the reduction by the tensor's shape. Unfused, the shared expert's sigmoid,
    product and add cost three more passes over [T, H].

    Grid ``(T, cdiv(H, BLOCK_H))``: a program adds ``BLOCK_H`` columns of one token's slots.

    Layouts: slots [T, top_k, H], shared [T, H], out [T, H], any row and slot strides, columns
    contiguous; shared_gate [T, 1] (the gate's logits), any row stride.

    Bound: memory. Bytes ``T * H * (top_k + 2) * element_size`` with a shared expert, ``T * H *
    (top_k + 1) * element_size`` without: a 16,384-token step at top-8, H = 2048 in bf16 moves
    671 MB, about 0.14 ms at an H200's 4.8 TB/s.
    """
    num_tokens, top_k, hidden_size = slots.shape
    if (shared is None) != (shared_gate is None):
        raise ValueError("a shared expert needs both its output and its gate's logits")
    if shared is not None:
        assert shared.shape == (num_tokens, hidden_size), tuple(shared.shape)
        assert shared_gate.shape == (num_tokens, 1), tuple(shared_gate.shape)
        assert shared.dtype == slots.dtype, f"shared {shared.dtype}, slots {slots.dtype}"
        assert shared.stride(-1) == 1, "the shared expert's columns must be contiguous"
    assert slots.stride(-1) == 1, "the slots' columns must be contiguous"
    out = slots.new_empty(num_tokens, hidden_size)
    if num_tokens == 0 or hidden_size == 0:
        return out
    # 1024 columns: 8 a thread at 4 warps (16-byte loads in 16 bits).
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    has_shared = shared is not None
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        out,
        slots,
        shared if has_shared else slots,  # unread without a shared expert
        shared_gate if has_shared else slots,
        hidden_size,
        slots.stride(0),
        slots.stride(1),
        shared.stride(0) if has_shared else 0,
        shared_gate.stride(0) if has_shared else 0,
        out.stride(0),
        TOP_K=top_k,
        HAS_SHARED=has_shared,
        BLOCK_H=block_h,
        **pdl_options(slots.device),
    )
    return out


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
    block_n = launch.gate_up_block_n if gated and launch.gate_up_block_n else launch.block_n
    num_warps = launch.down_num_warps if not gated and launch.down_num_warps else launch.num_warps
    grid = (triton.cdiv(num_sorted, launch.block_m) * triton.cdiv(n, block_n),)
    strides = b.stride()
    weights_tma = weights_by_tma(b)
    if weights_tma:
        # Imported here: only this path needs host-side descriptors, which older Triton lacks.
        from triton.tools.tensor_descriptor import TensorDescriptor

        b = TensorDescriptor.from_tensor(b.view(-1, b.shape[2]), [block_n, launch.block_k])
    _moe_gemm_kernel[grid](
        a, b, c, topk_weights, sorted_token_ids, expert_ids, num_post_padded,
        n, a.shape[1], c.shape[0], num_sorted,
        a.stride(0), a.stride(1), *strides, c.stride(0), c.stride(1),
        PAIRS_PER_ROW=pairs_per_row, GATED=gated, MUL_ROUTED_WEIGHT=not gated,
        INPUT_PRECISION="ieee" if a.dtype == torch.float32 else None,
        BLOCK_M=launch.block_m, BLOCK_N=block_n, BLOCK_K=launch.block_k, GROUP_M=launch.group_m,
        WEIGHTS_TMA=weights_tma, num_warps=num_warps, num_stages=launch.num_stages,
        **pdl_options(a.device),
    )  # fmt: skip


def weights_by_tma(weights: torch.Tensor) -> bool:
    """Whether the GEMMs load ``weights`` ([E, rows, K]) by TMA descriptor: on Hopper and later,
    16-bit, each expert's rows contiguous after the previous expert's (one [E * rows, K] matrix),
    rows 16-byte aligned."""
    return (
        platform_for(weights.device).supports_tma
        and weights.element_size() == 2
        and weights.stride(2) == 1
        and weights.stride(0) == weights.shape[1] * weights.stride(1)
        and weights.stride(1) * 2 % 16 == 0
        and weights.data_ptr() % 16 == 0
    )
