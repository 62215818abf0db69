"""The experts of a mixture-of-experts layer in plain torch: the CPU path and the oracle the Triton
kernel (``pagedllm.kernels.triton.fused_moe``) is tested against.

The (token, slot) pairs are sorted by expert, so each expert that received tokens runs two
matmuls over exactly its rows; experts that received none cost nothing, and no token is ever
multiplied by an expert it was not routed to. Reading the per-expert counts is a host sync, which
is why CUDA takes the kernel instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def fused_experts_torch(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation_qdq: Callable[[torch.Tensor], torch.Tensor] | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * down_e(act(gate_e(x_t), up_e(x_t)))`` with ``e = topk_ids[t, j]``.

    hidden_states: [num_tokens, hidden_size]; w13: [num_experts, 2 * intermediate, hidden_size]
    (each expert's gate rows, then its up rows); w2: [num_experts, hidden_size, intermediate];
    topk_weights: [num_tokens, top_k] (any float dtype); topk_ids: [num_tokens, top_k].
    activation_qdq: rounds each matmul's input as FP8 experts' format implies (None: no rounding).
    w13_bias: [num_experts, 2 * intermediate], w2_bias: [num_experts, hidden_size], or None;
    activation(gate, up): SwiGLU's ``silu(gate) * up`` unless the family has its own (gpt-oss).
    Returns [num_tokens, hidden_size] in the dtype of hidden_states.
    """
    num_tokens, top_k = topk_ids.shape
    intermediate = w2.shape[2]
    flat_ids = topk_ids.flatten()
    # order[i]: the flattened (token, slot) index of the i-th pair sorted by expert.
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0])
    hit = counts.nonzero().flatten()
    out = hidden_states.new_empty(num_tokens * top_k, hidden_states.shape[1])
    start = 0
    for expert, count in zip(hit.tolist(), counts[hit].tolist()):
        pairs = order[start : start + count]
        start += count
        x = hidden_states[pairs // top_k]
        gate_up = F.linear(
            x if activation_qdq is None else activation_qdq(x),
            w13[expert],
            None if w13_bias is None else w13_bias[expert],
        )
        act = activation(gate_up[:, :intermediate], gate_up[:, intermediate:])
        out[pairs] = F.linear(
            act if activation_qdq is None else activation_qdq(act),
            w2[expert],
            None if w2_bias is None else w2_bias[expert],
        )
    weighted = out.view(num_tokens, top_k, -1) * topk_weights.unsqueeze(-1).float()
    return weighted.sum(dim=1).to(hidden_states.dtype)
