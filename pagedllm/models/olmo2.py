"""OLMo-2 and EXAONE-4: Llama's blocks in a post-norm decoder layer, as Hugging Face transformers'
``Olmo2ForCausalLM`` and ``Exaone4ForCausalLM`` compute them.

The layer has no input norm; each block's output is normalized before its residual add::

    x = x + post_attention_layernorm(attn(x))
    x = x + post_feedforward_layernorm(mlp(x))

* OLMo-2: q and k RMS-normalized over the whole projection (all heads at once) before the rotation.
* EXAONE-4: q and k RMS-normalized per head; with a ``sliding_window``, the sliding layers rotate
  and the global ones are NoPE (no position in q and k); without one, every layer rotates.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig

from pagedllm.layers.layernorm import RMSNorm
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class PostNormDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: PretrainedConfig, *args: Any) -> None:
        """LlamaDecoderLayer's arguments."""
        super().__init__(config, *args)
        # No input norm: each block's output is normalized instead.
        del self.input_layernorm
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: the residual stream is hidden_states + residual, and the
        MLP's residual add is left to the next layer (or the final norm, which fuses it)."""
        stream = hidden_states if residual is None else hidden_states + residual
        attn_out = self.self_attn(positions, stream)
        stream = stream + self.post_attention_layernorm(attn_out)
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer = PostNormDecoderLayer


class Exaone4ForCausalLM(LlamaForCausalLM):
    decoder_layer = PostNormDecoderLayer

    @staticmethod
    def uses_rope(config: PretrainedConfig, layer_index: int) -> bool:
        if getattr(config, "sliding_window", None) is None:
            return True
        return config.layer_types[layer_index] == "sliding_attention"
