"""Mixture-of-experts layers: the router (softmax top-k) and FusedMoE, whose experts run one Triton
grouped GEMM on CUDA and a torch path (the reference) elsewhere."""

from pagedllm.layers.fused_moe.layer import FusedMoE
from pagedllm.layers.fused_moe.router import (
    select_experts,
    select_experts_group_limited,
    select_experts_grouped,
)
from pagedllm.layers.fused_moe.torch_moe import fused_experts_torch

__all__ = [
    "FusedMoE",
    "fused_experts_torch",
    "select_experts",
    "select_experts_group_limited",
    "select_experts_grouped",
]
