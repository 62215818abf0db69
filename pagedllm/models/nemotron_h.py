"""Nemotron-H (NVIDIA Nemotron-H 8B/47B/56B): a Mamba-2 hybrid, as Hugging Face transformers'
``NemotronHForCausalLM`` computes it.

Every layer is one pre-norm residual block whose mixer ``layers_block_type`` names:
``linear_attention`` (a Mamba-2 mixer, layers/linear_attention/mamba2.py, its state in the state
cache beside the paged KV), ``full_attention`` (grouped-query attention without positions: the
Mamba-2 layers carry order), or ``mlp`` (up, squared ReLU, down). The MoE layers of later
Nemotron releases (sigmoid-routed non-gated experts) are refused.

Only the attention layers have a KV cache (bound to them in order, attention/forward_context.py).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention import Attention
from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.linear_attention.mamba2 import Mamba2Mixer, Mamba2Spec
from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from pagedllm.models.mamba2_hybrid import ATTENTION, MAMBA, Mamba2HybridForCausalLM
from pagedllm.models.utils import DecoderModel, make_stage_layers, pre_norm

MLP = "mlp"
# Checkpoint name prefixes -> ours (the "model." decoder's names, DecoderModel's).
_CHECKPOINT_PREFIXES = (
    ("backbone.embeddings.", "model.embed_tokens."),
    ("backbone.norm_f.", "model.norm."),
    ("backbone.", "model."),
)


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

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_tokens, hidden_size] -> same shape."""
        q, k, v = self.qkv_proj(hidden_states).split(self.sizes, dim=-1)
        return self.o_proj(self.attn(q, k, v))


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
            self.mixer = Mamba2Mixer(Mamba2Spec.from_nemotron_h(config))
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
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions are unused: no layer rotates (attention here has no positional encoding).
        Returns (block output, residual stream), the residual add deferred to the next norm."""
        hidden_states, residual = pre_norm(self.norm, hidden_states, residual)
        return self.mixer(hidden_states), residual


class NemotronHModel(DecoderModel):
    """The checkpoints' ``embeddings`` and ``norm_f`` are our ``embed_tokens`` and ``norm``
    (``NemotronHForCausalLM._param_name``)."""

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = make_stage_layers(
            config.num_hidden_layers, lambda i: NemotronHBlock(config, i, attn_backend)
        )
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)


class NemotronHForCausalLM(Mamba2HybridForCausalLM):
    rotary: ClassVar[bool] = False
    mixer_name: ClassVar[str] = "mixer"
    mamba2_spec = staticmethod(Mamba2Spec.from_nemotron_h)
    packed_modules_mapping: ClassVar[dict[str, tuple[tuple[str, int | str], ...]]] = {
        "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    }

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.model = NemotronHModel(config, attn_backend)
        self.init_lm_head(config, self.model.embed_tokens)

    def _param_name(self, ckpt_name: str) -> tuple[str, int | str | None]:
        # NVIDIA's checkpoints (and transformers' save_pretrained) name the decoder "backbone",
        # its embedding and final norm as our decoder does not.
        for ckpt_prefix, prefix in _CHECKPOINT_PREFIXES:
            if ckpt_name.startswith(ckpt_prefix):
                ckpt_name = prefix + ckpt_name.removeprefix(ckpt_prefix)
                break
        return super()._param_name(ckpt_name)
