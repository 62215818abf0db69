"""DeepSeek-V3 / R1 and Kimi-K2 (``DeepseekV3ForCausalLM``): DeepSeek-V2's multi-head latent
attention (``deepseek_v2.MLAAttention``, the latent cache and all) with GLM-4-MoE's experts: a
sigmoid router with a load-balancing bias, group-limited top-k (``noaux_tc``), ``norm_topk_prob``
and ``routed_scaling_factor`` (``glm4_moe.GroupedTopkRouter``), plus shared experts, after
``first_k_dense_replace`` dense layers. The multi-token-prediction layer a checkpoint stores as
layer ``num_hidden_layers`` is skipped at load with a notice (``SkipsMtpLayers``).
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from pagedllm.models.deepseek_v2 import DeepseekV2ForCausalLM
from pagedllm.models.glm4_moe import SharedExpertsMoeBlock, SkipsMtpLayers
from pagedllm.models.llama import LlamaMLP


class DeepseekV3ForCausalLM(SkipsMtpLayers, DeepseekV2ForCausalLM):
    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_index: int) -> nn.Module:
        if layer_index < config.first_k_dense_replace:
            return LlamaMLP(config)
        return SharedExpertsMoeBlock(config)  # GLM-4-MoE's router is V3's
