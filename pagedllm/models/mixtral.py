"""Mixtral (8x7B, 8x22B): Mistral's attention with a mixture of experts in every layer, as Hugging
Face transformers' ``MixtralForCausalLM`` computes it. The router always renormalises the top-k
probabilities; the checkpoint calls the block ``block_sparse_moe`` and the expert projections
``w1`` (gate), ``w3`` (up) and ``w2`` (down).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn
from transformers import PretrainedConfig

from pagedllm.models.moe import MoeForCausalLM, SparseMoeBlock


class MixtralForCausalLM(MoeForCausalLM):
    moe_module: ClassVar[str] = "block_sparse_moe"
    expert_projections: ClassVar[tuple[str, str, str]] = ("w1", "w3", "w2")

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_index: int) -> nn.Module:
        return SparseMoeBlock(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,
            hidden_act=config.hidden_act,
        )
