"""Nemotron-H (NVIDIA Nemotron-H 8B/47B/56B): a Mamba-2 hybrid, as Hugging Face transformers'
``NemotronHForCausalLM`` computes it.

Every layer is one pre-norm residual block whose mixer ``layers_block_type`` names:
``linear_attention`` (a Mamba-2 mixer, layers/linear_attention/mamba2.py, its state in the state
cache beside the paged KV), ``full_attention`` (grouped-query attention without positions: the
Mamba-2 layers carry order), or ``mlp`` (up, squared ReLU, down). The MoE layers of later
Nemotron releases (sigmoid-routed non-gated experts) are refused.

Only the attention layers have a KV cache: ``kv_caches`` holds one per such layer, in order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention import Attention, AttentionMetadata
from pagedllm.attention.backends.abstract import AttentionBackend, KVCache
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.linear_attention.mamba2 import Mamba2Mixer
from pagedllm.layers.linear_attention.state import LayerStateShape
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.utils import CausalLM

MAMBA, ATTENTION, MLP = "linear_attention", "full_attention", "mlp"


class NemotronHAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias
        )
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.sizes = [num_heads * self.head_dim, num_kv_heads * self.head_dim, num_kv_heads * self.head_dim]
        self.attn = Attention(num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads, attn_backend)

    def forward(
        self, hidden_states: torch.Tensor, kv_cache: KVCache, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """hidden_states: [num_tokens, hidden_size] -> same shape."""
        q, k, v = self.qkv_proj(hidden_states).split(self.sizes, dim=-1)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class NemotronHMLP(nn.Module):
    """up_proj, squared ReLU, down_proj (no gate)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.mlp_hidden_act != "relu2":
            raise ValueError(f"mlp_hidden_act must be 'relu2', got {config.mlp_hidden_act!r}")
        self.up_proj = ColumnParallelLinear(
            config.hidden_size, config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHBlock(nn.Module):
    def __init__(
        self, config: PretrainedConfig, layer_index: int, attn_backend: type[AttentionBackend]
    ) -> None:
        super().__init__()
        self.block_type = config.layers_block_type[layer_index]
        if self.block_type == MAMBA:
            if config.mamba_hidden_act != "silu":
                raise ValueError(f"mamba_hidden_act must be 'silu', got {config.mamba_hidden_act!r}")
            self.mixer = Mamba2Mixer(config)
        elif self.block_type == ATTENTION:
            self.mixer = NemotronHAttention(config, attn_backend)
        elif self.block_type == MLP:
            self.mixer = NemotronHMLP(config)
        else:
            raise ValueError(
                f"layers_block_type {self.block_type!r} (layer {layer_index}) is not supported; "
                f"supported: {[MAMBA, ATTENTION, MLP]}"
            )
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache | None,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (block output, residual stream), the residual add deferred to the next norm."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.norm(hidden_states)
        else:
            hidden_states, residual = self.norm(hidden_states, residual)
        if self.block_type == MAMBA:
            return self.mixer(hidden_states, attn_metadata), residual
        if self.block_type == ATTENTION:
            return self.mixer(hidden_states, kv_cache, attn_metadata), residual
        return self.mixer(hidden_states), residual


class NemotronHModel(nn.Module):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            NemotronHBlock(config, i, attn_backend) for i in range(config.num_hidden_layers)
        )
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """positions are unused: no layer rotates (attention here has no positional encoding)."""
        hidden_states = self.embeddings(input_ids)
        residual = None
        attention_caches = iter(kv_caches)
        for layer in self.layers:
            kv_cache = next(attention_caches) if layer.block_type == ATTENTION else None
            hidden_states, residual = layer(hidden_states, residual, kv_cache, attn_metadata)
        hidden_states, _ = self.norm_f(hidden_states, residual)
        return hidden_states


class NemotronHForCausalLM(CausalLM):
    rotary: ClassVar[bool] = False
    packed_modules_mapping: ClassVar[dict[str, tuple[tuple[str, int | str], ...]]] = {
        "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    }

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = NemotronHModel(config, attn_backend)
        if self.tie_word_embeddings:
            self.lm_head = self.model.embeddings
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def _param_name(self, ckpt_name: str) -> tuple[str, int | str | None]:
        # NVIDIA's checkpoints (and transformers' save_pretrained) name the decoder "backbone".
        if ckpt_name.startswith("backbone."):
            ckpt_name = "model." + ckpt_name.removeprefix("backbone.")
        return super()._param_name(ckpt_name)

    # --- the hybrid model's interface (worker/state_cache.py) -----------------------------------

    @staticmethod
    def num_attention_layers(config: PretrainedConfig) -> int:
        return sum(kind == ATTENTION for kind in config.layers_block_type)

    @staticmethod
    def state_shapes(config: PretrainedConfig, tp_size: int) -> list[LayerStateShape]:
        """The Mamba-2 layers' states, whole on every rank (their mixers are replicated)."""
        return [Mamba2Mixer.state_shape_of(config) for kind in config.layers_block_type if kind == MAMBA]

    def linear_attention_layers(self) -> Iterator[Mamba2Mixer]:
        return (layer.mixer for layer in self.model.layers if layer.block_type == MAMBA)
