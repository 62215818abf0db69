"""A mixture-of-experts router's softmax and top-k in one kernel (``topk_softmax``), with the
semantics of ``layers/fused_moe/router.py``'s ``select_experts``: the softmax over the experts in
float32 whatever the logits' dtype, the ``top_k`` most probable experts in descending probability,
their probabilities renormalised to sum to 1 when asked.

Unfused, torch runs a softmax, topk's two kernels (a radix select and a sort), then a sum, a
division and a copy: half a dozen launches per layer of a decode step for a few KiB of data.
Here one launch reads the logits once and writes the weights and ids.

Algorithm, per token (one row of ``E`` logits, held in registers)::

    m = max(x);  s = sum(exp(x - m))                        # float32
    repeat top_k times:
        e = the expert not yet taken with the largest x, the lowest index among equals
        take e, with weight exp(x[e] - m) / s               # softmax's value at e
    renormalise: w = w / sum(w)                             # when ``renormalize``

The order is taken on the float32 logits, not on the probabilities: softmax is monotone, so it
is the same order, and it does not depend on how exp rounds (Triton's and torch's exp may differ
in the last bit). Ties (equal logits) go to the lowest expert index, a deterministic rule;
torch.topk leaves the order of ties unspecified, so ids may differ from select_experts' only
among equal probabilities. Each round is one max over int64 keys that order the experts by
(logit, then lower index), so the argmax and its tie-break are a single reduction. A row of NaN
logits (a broken model) still yields distinct in-range ids: an id past the experts would send
the grouped GEMMs out of bounds.

Grid: ``(cdiv(num_tokens, BLOCK_T),)``; a program routes ``BLOCK_T`` tokens, its
``[BLOCK_T, BLOCK_E]`` tile of logits in registers: a row max and a row sum for the softmax,
then ``top_k`` rounds of a row max over the keys. ``BLOCK_T`` and the warps depend on ``E``
alone, so a token's result is the same bits whatever batch it is in.

Shared experts absorbed as experts (``num_shared`` > 0; ``layers/fused_moe/layer.py``): every
token also takes experts ``E .. E + num_shared - 1``, in slots ``top_k ..``, after the routed slots
and outside their renormalisation, each weighted 1, or ``sigmoid(x[E])`` with ``shared_gate``,
where the logits' last column is the shared expert's gate (Qwen3-Next's, its router and gate
one GEMM).

Layouts: router_logits ``[num_tokens, E (+ 1 with shared_gate)]``, any strides; topk_weights
``[num_tokens, top_k + num_shared]`` float32 and topk_ids likewise int64 (select_experts'
dtypes), contiguous.

Bound: latency (a few rounds of reductions over a row). Bytes ``num_tokens * (E * element_size +
12 * (top_k + num_shared))``: 256 tokens of 16 experts at top-8 read 8 KiB and write 24 KiB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel

# The key of a taken expert or a padding column: the smallest int64.
_NO_EXPERT = tl.constexpr(-(2**63))

# The widest expert row a program holds in registers (BLOCK_T = 1, 16 warps: 8 logits a thread).
# Released MoE models have at most 512 experts.
MAX_EXPERTS = 4096


# The token count changes every step: specialising on its divisibility would compile mid-run.
@triton.jit(do_not_specialize=["num_tokens"])
def _topk_softmax_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    num_experts,
    stride_logits_t,
    stride_logits_e,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    NUM_SHARED: tl.constexpr,
    SHARED_GATE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    row_mask = rows < num_tokens
    expert_mask = experts < num_experts
    logits = tl.load(
        logits_ptr + rows.to(tl.int64)[:, None] * stride_logits_t + experts[None, :] * stride_logits_e,
        mask=row_mask[:, None] & expert_mask[None, :],
        other=float("-inf"),
    ).to(tl.float32)
    # Rows past the end read as zeros (not -inf, whose max would make exp(-inf - -inf) a NaN).
    logits = tl.where(row_mask[:, None], logits, 0.0)
    row_max = tl.max(logits, 1)
    denom = tl.sum(tl.exp(logits - row_max[:, None]), 1)  # the padding columns: exp(-inf) = 0

    # One int64 key an expert, ordered as (logit, then the lower index) so that a row's max is its
    # next expert, ties included, in one reduction: the logit's float32 bits made monotone as a
    # signed integer (negative floats' magnitude bits flipped; -0.0 first made +0.0, which it
    # equals) in the high half, BLOCK_E - 1 - index in the low half. Taken experts and the
    # padding hold the smallest int64 (below every logit's key, NaNs included).
    bits = tl.where(logits == 0.0, 0.0, logits).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    keys = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - experts).to(tl.int64)[None, :]
    keys = tl.where(expert_mask[None, :], keys, _NO_EXPERT)
    slots = tl.arange(0, BLOCK_K)
    topk_weights = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    topk_ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(keys, 1)
        chosen = (BLOCK_E - 1 - (best & (BLOCK_E - 1))).to(tl.int32)
        # Its logit back from the key, and softmax's value there: exp(x - m) / sum, as for the row.
        high = (best >> 32).to(tl.int32)
        logit = tl.where(high < 0, high ^ 0x7FFFFFFF, high).to(tl.float32, bitcast=True)
        weight = tl.exp(logit - row_max) / denom
        topk_weights = tl.where(slots[None, :] == j, weight[:, None], topk_weights)
        topk_ids = tl.where(slots[None, :] == j, chosen[:, None], topk_ids)
        keys = tl.where(experts[None, :] == chosen[:, None], _NO_EXPERT, keys)
    if RENORMALIZE:
        # The slots past TOP_K hold 0 and add nothing.
        topk_weights = topk_weights / tl.sum(topk_weights, 1)[:, None]
    if NUM_SHARED:
        shared_weight = tl.full([BLOCK_T], 1.0, tl.float32)
        if SHARED_GATE:
            gate = tl.load(logits_ptr + rows.to(tl.int64) * stride_logits_t + num_experts * stride_logits_e,
                           mask=row_mask, other=0.0).to(tl.float32)  # fmt: skip
            shared_weight = 1.0 / (1.0 + tl.exp(-gate))
        is_shared = (slots >= TOP_K) & (slots < TOP_K + NUM_SHARED)
        topk_weights = tl.where(is_shared[None, :], shared_weight[:, None], topk_weights)
        topk_ids = tl.where(is_shared[None, :], num_experts + slots[None, :] - TOP_K, topk_ids)

    out_offsets = rows.to(tl.int64)[:, None] * (TOP_K + NUM_SHARED) + slots[None, :]
    out_mask = row_mask[:, None] & (slots[None, :] < TOP_K + NUM_SHARED)
    tl.store(weights_ptr + out_offsets, topk_weights, mask=out_mask)
    tl.store(ids_ptr + out_offsets, topk_ids.to(tl.int64), mask=out_mask)


def topk_softmax(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    num_shared: int = 0,
    shared_gate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [num_tokens, num_experts] (any float dtype) -> (topk_weights [num_tokens,
    top_k] float32, topk_ids [num_tokens, top_k] int64), each row's experts in descending
    probability, ties to the lowest index (see the module doc). ``select_experts``'s result, in one
    kernel. ValueError for more than ``MAX_EXPERTS`` experts or a top_k outside [1, num_experts].

    num_shared: absorbed shared experts, appended as slots ``top_k ..`` with ids ``num_experts ..``
    (``router.append_shared_slots``'s result); their weight is 1, or with ``shared_gate`` the
    sigmoid of the logits' last column, which is then not an expert."""
    num_tokens, num_experts = router_logits.shape
    num_experts -= int(shared_gate)
    if shared_gate and not num_shared:
        raise ValueError("shared_gate needs a shared expert (num_shared >= 1)")
    if num_experts > MAX_EXPERTS:
        raise ValueError(
            f"topk_softmax holds a token's expert row in registers: at most {MAX_EXPERTS} experts, "
            f"got {num_experts}"
        )
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    device = router_logits.device
    topk_weights = torch.empty(num_tokens, top_k + num_shared, dtype=torch.float32, device=device)
    topk_ids = torch.empty(num_tokens, top_k + num_shared, dtype=torch.int64, device=device)
    if num_tokens == 0:
        return topk_weights, topk_ids
    block_t, block_e, num_warps = _tiles(num_experts)
    _topk_softmax_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits,
        topk_weights,
        topk_ids,
        num_tokens,
        num_experts,
        router_logits.stride(0),
        router_logits.stride(1),
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        NUM_SHARED=num_shared,
        SHARED_GATE=shared_gate,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k + num_shared),
        num_warps=num_warps,
        **pdl_options(device),
    )
    return topk_weights, topk_ids


def _tiles(num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_E, num_warps) for a row of ``num_experts`` logits: up to 16 tokens and 2,048
    logits a program, about 8 logits a thread, so that a decode step of a few hundred tokens
    spreads over a few dozen programs. A function of the expert count alone: the reductions'
    layout, and so a token's bits, never depend on the batch."""
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(16, 2048 // block_e))
    num_warps = max(1, min(16, block_t * block_e // 256))
    return block_t, block_e, num_warps
