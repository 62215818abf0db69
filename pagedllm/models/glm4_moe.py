"""GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``): Llama's attention with biased q/k/v, optional
per-head q/k norm (``use_qk_norm``) and a rotation of half of each head (``partial_rotary_factor``),
then a mixture of experts with shared experts, as Hugging Face transformers computes it.

* Layers ``< first_k_dense_replace`` take the SwiGLU MLP of width ``intermediate_size``.
* The others: a group-limited sigmoid router with a load-balancing bias
  (``router.select_experts_grouped``: DeepSeek-V3's ``noaux_tc``), ``n_routed_experts`` experts
  of width ``moe_intermediate_size``, plus a shared SwiGLU MLP of width ``n_shared_experts *
  moe_intermediate_size`` that every token takes.
* The multi-token-prediction layers a checkpoint may carry past ``num_hidden_layers``
  (``num_nextn_predict_layers``) are not part of the model, as in transformers
  (``SkipsMtpLayers``); speculative decoding's ``"mtp"`` method drafts with them (models/mtp.py).
"""

from __future__ import annotations

import logging
import re

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedllm.layers.fused_moe import FusedMoE, select_experts_grouped
from pagedllm.models.llama import LlamaMLP
from pagedllm.models.moe import MoeForCausalLM

logger = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class GroupedTopkRouter(nn.Module):
    """The router's weights as checkpoints name them (``gate.weight``,
    ``gate.e_score_correction_bias``); logits in float32, as the reference keeps this layer."""

    # Its float32 logits come from cuBLAS, whose kernel the batch's row count chooses.
    has_batch_invariant_form = False

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        num_experts = config.n_routed_experts
        if config.n_group < 1 or num_experts % config.n_group:
            raise ValueError(f"n_group ({config.n_group}) must divide n_routed_experts ({num_experts})")
        if not 1 <= config.topk_group <= config.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={config.n_group}], got {config.topk_group}")
        if num_experts // config.n_group < 2:
            raise ValueError("each expert group needs >= 2 experts (a group scores its best two)")
        self.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)
        self.top_k = config.num_experts_per_tok
        self.num_groups, self.topk_groups = config.n_group, config.topk_group
        self.renormalize = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states: [num_tokens, hidden_size] -> (topk_weights, topk_ids): [num_tokens, top_k]."""
        logits = F.linear(hidden_states.float(), self.weight.float())
        return select_experts_grouped(
            logits,
            self.top_k,
            self.num_groups,
            self.topk_groups,
            self.e_score_correction_bias,
            self.renormalize,
            self.routed_scaling_factor,
        )


class SharedExpertsMoeBlock(nn.Module):
    """Routed experts plus shared experts every token takes; ``gate``: hidden_states ->
    (topk_weights, topk_ids), GLM-4-MoE's router unless given another (DeepSeek-V2's)."""

    def __init__(self, config: PretrainedConfig, gate: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = gate or GroupedTopkRouter(config)
        self.experts = FusedMoE(
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=False,  # the router has done it
        )
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = LlamaMLP(config, intermediate_size=shared)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_tokens, hidden_size] -> same shape."""
        routed = self.experts.forward_routed(hidden_states, *self.gate(hidden_states))
        return routed + self.shared_experts(hidden_states)


class SkipsMtpLayers:
    """Skips, with a notice, the multi-token-prediction layers a checkpoint stores past the
    decoder's (index >= ``num_hidden_layers``): they load only as speculative decoding's ``"mtp"``
    method's drafter (models/mtp.py), as in vLLM."""

    _mtp_notice_given = False

    def _is_skipped(self, ckpt_name: str) -> bool:
        match = _LAYER_INDEX.match(ckpt_name)
        if match and int(match[1]) >= len(self.model.layers):
            if not self._mtp_notice_given:
                logger.info(
                    "skipping the multi-token-prediction layer(s) from %s on (speculative_config "
                    "method 'mtp' drafts with them)",
                    ckpt_name,
                )
                self._mtp_notice_given = True
            return True
        return super()._is_skipped(ckpt_name)


class Glm4MoeForCausalLM(SkipsMtpLayers, MoeForCausalLM):
    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_index: int) -> nn.Module:
        if layer_index < config.first_k_dense_replace:
            return LlamaMLP(config)
        return SharedExpertsMoeBlock(config)
