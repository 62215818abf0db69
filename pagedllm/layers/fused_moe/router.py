"""The router of a mixture-of-experts layer: softmax over the experts, the top-k, optionally
renormalised (Mixtral always; Qwen3-MoE when ``norm_topk_prob``), as Hugging Face transformers'
``MixtralTopKRouter`` and ``Qwen3MoeTopKRouter`` compute it."""

from __future__ import annotations

import torch


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [num_tokens, num_experts] -> (topk_weights [num_tokens, top_k] float32,
    topk_ids [num_tokens, top_k] int64), each row's experts in descending probability.

    The softmax runs in float32 whatever the model's dtype, and the weights stay float32 (HF
    Qwen3-MoE rounds them to the model dtype; in float32 the two agree exactly).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids
