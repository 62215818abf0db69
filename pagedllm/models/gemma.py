"""Gemma 2 and Gemma 3 (text), in one implementation on the Llama blocks.

What they add to the Llama decoder (as Hugging Face's modeling_gemma2 / modeling_gemma3 compute it):

* Embeddings scaled by ``sqrt(hidden_size)`` (the scale rounded to the model dtype).
* ``(1 + w)`` RMSNorms (``GemmaRMSNorm``) and "sandwich" norms: the attention and MLP outputs are
  normalized again before each residual add (``post_attention_layernorm``,
  ``post_feedforward_layernorm``), the MLP input by ``pre_feedforward_layernorm``.
* GeGLU MLP (``gelu_pytorch_tanh``), softmax scale ``query_pre_attn_scalar ** -0.5``.
* Local and global layers (``layer_types``): local ones attend through ``sliding_window``.
* Gemma 2: attention logits soft-capped by ``attn_logit_softcapping`` (in the attention kernels)
  and final logits by ``final_logit_softcapping``.
* Gemma 3: RMSNorm over each head's q and k, and a rotary base per layer type (``rope_parameters``
  keyed by layer type in transformers 5; ``rope_local_base_freq`` for local layers in older
  configs), the global one possibly scaled (linear, yarn, ...).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.layers.layernorm import GemmaRMSNorm
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.rotary_embedding import RotaryEmbedding, get_rope_parameters
from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from pagedllm.models.llama import (
    AttentionOptions,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    rotary_embedding,
)
from pagedllm.models.utils import (
    DecoderModel,
    attention_sinks,
    layer_sliding_windows,
    make_stage_layers,
    pre_norm,
)


def _hidden_act(config: PretrainedConfig) -> str:
    return getattr(config, "hidden_activation", None) or config.hidden_act


def _rope_parameters(config: PretrainedConfig, layer_type: str) -> dict[str, Any]:
    params = get_rope_parameters(config, layer_type)
    local_base = getattr(config, "rope_local_base_freq", None)
    if (
        layer_type == "sliding_attention"
        and local_base is not None
        and "sliding_attention" not in (getattr(config, "rope_parameters", None) or {})
    ):
        # Older Gemma 3 configs: one rope_scaling for global layers, a plain local base.
        params = {"rope_type": "default", "rope_theta": local_base}
    return params


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        rotary_emb: RotaryEmbedding,
        attn_backend: type[AttentionBackend],
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        options = AttentionOptions(
            qkv_bias=getattr(config, "attention_bias", False),
            o_bias=getattr(config, "attention_bias", False),
            qk_norm=config.model_type.startswith("gemma3"),
            scale=config.query_pre_attn_scalar**-0.5,
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
            norm_class=GemmaRMSNorm,
        )
        self.self_attn = LlamaAttention(config, rotary_emb, attn_backend, sliding_window, options)
        self.mlp = LlamaMLP(config, _hidden_act(config))
        eps, size = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: the residual adds are deferred to the next norm."""
        hidden_states, residual = pre_norm(self.input_layernorm, hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class GemmaModel(DecoderModel):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (a causal LM attends causally)")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # The reference rounds the scale to the model dtype before multiplying.
        # (On the CPU: the model may be built on the meta device to measure it.)
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.get_default_dtype(), device="cpu")
        self.embed_scale = scale.item()
        windows = layer_sliding_windows(config)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * len(windows)
        # One cos/sin table per layer type (they differ in Gemma 3, and may in Gemma 2 configs).
        unbounded = attention_sinks(config) > 0
        rotary = {
            layer_type: rotary_embedding(config, _rope_parameters(config, layer_type), unbounded)
            for layer_type in sorted(set(layer_types))
        }
        self.layers = make_stage_layers(
            len(windows),
            lambda i: GemmaDecoderLayer(config, rotary[layer_types[i]], attn_backend, windows[i]),
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class SoftCappedLogitsProcessor(LogitsProcessor):
    """Final logits squashed into (-cap, cap): ``cap * tanh(logits / cap)`` (Gemma 2)."""

    def __init__(self, vocab_size: int, cap: float) -> None:
        super().__init__(vocab_size)
        self.cap = cap

    def forward(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().forward(lm_head, hidden_states)
        return torch.tanh(logits / self.cap) * self.cap


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 and Gemma 3 text: Llama's checkpoint names and interface over the Gemma decoder.
    The LM head is always the embedding (Gemma ties them)."""

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        nn.Module.__init__(self)
        self.tie_word_embeddings = True
        self.model = GemmaModel(config, attn_backend)
        self.lm_head = self.model.embed_tokens
        cap = getattr(config, "final_logit_softcapping", None)
        self.logits_processor = (
            LogitsProcessor(config.vocab_size)
            if cap is None
            else SoftCappedLogitsProcessor(config.vocab_size, cap)
        )
