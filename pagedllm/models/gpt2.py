"""GPT-2 (Radford et al. 2019), as Hugging Face's GPT2LMHeadModel computes it.

Pre-norm LayerNorm blocks, learned absolute position embeddings (``wpe``) added to the token
embeddings, multi-head attention with one fused ``c_attn`` projection, a GELU (tanh) MLP, and the
LM head tied to the token embedding. Checkpoints store the projections as ``Conv1D`` weights,
``[in_features, out_features]``: transposed once at load time into our ``[out, in]`` linears.
The module tree mirrors the checkpoint's names (``transformer.h.0.attn.c_attn``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention import Attention
from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from pagedllm.models.utils import CausalLM, read_whole

# config.activation_function -> the GELU variant (Hugging Face's ACT2FN names).
_GELU_APPROXIMATION = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
_CONV1D_WEIGHTS = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


def check_gpt2_config(config: PretrainedConfig) -> None:
    """ValueError naming the field for the GPT-2 options we do not implement."""
    if config.activation_function not in _GELU_APPROXIMATION:
        raise ValueError(
            f"activation_function {config.activation_function!r} is not supported; "
            f"supported: {sorted(_GELU_APPROXIMATION)}"
        )
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        raise ValueError("scale_attn_by_inverse_layer_idx=True is not supported")
    if not getattr(config, "scale_attn_weights", True):
        raise ValueError("scale_attn_weights=False is not supported")


class GPT2Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // num_heads
        self.c_attn = QKVParallelLinear(hidden, self.head_dim, num_heads, num_heads, bias=True)
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True)
        self.num_heads = self.c_attn.num_heads  # this rank's
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_heads, attn_backend
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_tokens, hidden_size] -> same shape."""
        q, k, v = self.c_attn(hidden_states).chunk(3, dim=-1)
        return self.c_proj(self.attn(q, k, v))


class GPT2MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        inner = getattr(config, "n_inner", None) or 4 * config.hidden_size
        self.c_fc = ColumnParallelLinear(config.hidden_size, inner, bias=True)
        self.c_proj = RowParallelLinear(inner, config.hidden_size, bias=True)
        self.approximate = _GELU_APPROXIMATION[config.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class GPT2Block(nn.Module):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, attn_backend)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # Positions are replicated: every rank adds the same position embedding.
        self.wpe = nn.Embedding(config.n_positions, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, attn_backend) for _ in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            hidden_states = block(hidden_states)
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(CausalLM):
    rotary = False  # learned position embeddings
    # Causal-mask buffers that older checkpoints saved.
    skipped_checkpoint_names = (".attn.bias", ".attn.masked_bias")

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        check_gpt2_config(config)
        self.tie_word_embeddings = True
        self.transformer = GPT2Model(config, attn_backend)
        self.model = self.transformer
        self.lm_head = self.transformer.wte
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def _checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, str, int | str | None, torch.Tensor]]:
        for ckpt_name, name, shard_id, tensor in super()._checkpoint_tensors(weights):
            # Bare GPT2Model checkpoints name the blocks without the "transformer." prefix.
            name = name if name.startswith("transformer.") else f"transformer.{name}"
            if name.endswith(_CONV1D_WEIGHTS):
                tensor = read_whole(tensor).t()
            yield ckpt_name, name, shard_id, tensor
