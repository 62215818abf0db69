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


def append_shared_slots(
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    num_shared: int,
    shared_gate_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A routing with ``num_shared`` absorbed shared experts (ids ``num_experts ..``, after the
    routed ones) appended to every token as slots ``top_k ..``: [num_tokens, top_k] each ->
    [num_tokens, top_k + num_shared]. Their weight is 1, or ``sigmoid(shared_gate_logits)``
    ([num_tokens, 1], the shared expert's gate) in float32."""
    num_tokens = topk_ids.shape[0]
    ids = torch.arange(num_experts, num_experts + num_shared, device=topk_ids.device)
    if shared_gate_logits is None:
        weights = topk_weights.new_ones(num_tokens, num_shared)
    else:
        weights = torch.sigmoid(shared_gate_logits.float()).expand(num_tokens, num_shared)
    return (
        torch.cat([topk_weights, weights.to(topk_weights.dtype)], dim=1),
        torch.cat([topk_ids, ids.expand(num_tokens, num_shared).to(topk_ids.dtype)], dim=1),
    )


def select_experts_grouped(
    router_logits: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    correction_bias: torch.Tensor,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k over sigmoid scores (DeepSeek-V3's ``noaux_tc``, GLM-4-MoE), as
    transformers' ``Glm4MoeTopkRouter`` computes it.

    The experts are split into ``num_groups`` equal groups; a group scores the sum of its two best
    biased scores (``sigmoid(logit) + correction_bias``: the bias balances the load and only
    chooses, it never weighs); the ``topk_groups`` best groups are kept and the ``top_k`` best
    biased scores among their experts chosen. Their unbiased sigmoid scores are the weights,
    renormalised when ``renormalize``, then multiplied by ``routed_scaling_factor``.

    router_logits: [num_tokens, num_experts]; correction_bias: [num_experts]. Returns
    (topk_weights [num_tokens, top_k] float32, topk_ids [num_tokens, top_k] int64).
    """
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.float().sigmoid()
    biased = scores + correction_bias.float()
    grouped = biased.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [num_tokens, num_groups]
    kept_groups = group_scores.topk(topk_groups, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
    topk_ids = biased.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


def select_experts_group_limited(
    router_logits: torch.Tensor,
    top_k: int,
    num_groups: int | None,
    topk_groups: int | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's routing, as transformers' ``DeepseekV2TopkRouter`` computes it: softmax over
    the experts, then (``group_limited_greedy``, with ``num_groups``) only the ``topk_groups``
    groups with the best single expert keep their scores; the top-k scores, not renormalised,
    times ``routed_scaling_factor``. None for the groups: plain top-k (``greedy``).

    router_logits: [num_tokens, num_experts] -> (topk_weights float32, topk_ids), [num_tokens, top_k].
    """
    scores = router_logits.float().softmax(dim=-1)
    if num_groups is not None:
        num_tokens, num_experts = scores.shape
        grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
        kept_groups = grouped.amax(dim=-1).topk(topk_groups, dim=-1).indices
        group_mask = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=scores.device)
        group_mask.scatter_(1, kept_groups, True)
        scores = scores.masked_fill(~group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, -1), 0.0)
    topk_weights, topk_ids = scores.topk(top_k, dim=-1)
    return topk_weights * routed_scaling_factor, topk_ids
