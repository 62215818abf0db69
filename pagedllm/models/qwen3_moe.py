"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): Qwen3's attention (per-head
q/k RMSNorm) with mixture-of-experts feed-forward blocks, as Hugging Face transformers'
``Qwen3MoeForCausalLM`` computes it.

Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step !=
0``; its router renormalises the top-k probabilities when ``norm_topk_prob``. Dense layers take
the SwiGLU MLP of width ``intermediate_size``; experts have width ``moe_intermediate_size``.
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from pagedllm.models.llama import LlamaMLP
from pagedllm.models.moe import MoeForCausalLM, SparseMoeBlock


def is_sparse_layer(config: PretrainedConfig, layer_index: int) -> bool:
    step = config.decoder_sparse_step
    return (
        layer_index not in (config.mlp_only_layers or [])
        and config.num_experts > 0
        and (layer_index + 1) % step == 0
    )


class Qwen3MoeForCausalLM(MoeForCausalLM):
    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_index: int) -> nn.Module:
        if not is_sparse_layer(config, layer_index):
            return LlamaMLP(config)
        return SparseMoeBlock(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
            hidden_act=config.hidden_act,
        )
