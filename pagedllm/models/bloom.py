"""BLOOM (BigScience 2022), as Hugging Face's BloomForCausalLM computes it.

Pre-norm LayerNorm blocks with a LayerNorm right after the token embedding
(``word_embeddings_layernorm``), no position embeddings: every head adds an ALiBi bias
``slope * (key_pos - query_pos)`` to its scores (Press et al. 2022), applied by the attention
backends. The fused ``query_key_value`` checkpoint interleaves the projections per head,
``[num_heads, 3, head_dim]`` rows; it is regrouped at load time into our ``[q | k | v]`` layout,
so the tensor-parallel QKV layer splits it by head as usual. GELU (tanh) MLP; the LM head is the
token embedding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention import Attention
from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.distributed import get_tensor_model_parallel_rank
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from pagedllm.models.utils import CausalLM, read_whole


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """[num_heads] float32: the ALiBi paper's geometric slopes ``2^(-8 i / n)`` for the closest power
    of two ``n <= num_heads``, and for the remaining heads every other slope of ``2n`` (BLOOM's
    and the paper's reference code's rule)."""
    closest = 2 ** math.floor(math.log2(num_heads))

    def geometric(n: int, powers: torch.Tensor) -> torch.Tensor:
        base = torch.tensor(2 ** (-(2 ** -(math.log2(n) - 3))), dtype=torch.float32)
        return torch.pow(base, powers)

    slopes = geometric(closest, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != num_heads:
        extra = torch.arange(1, 1 + 2 * (num_heads - closest), 2, dtype=torch.int32)
        slopes = torch.cat([slopes, geometric(2 * closest, extra)])
    return slopes


class BloomAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // num_heads
        self.query_key_value = QKVParallelLinear(hidden, head_dim, num_heads, num_heads, bias=True)
        self.dense = RowParallelLinear(hidden, hidden, bias=True)
        local_heads = self.query_key_value.num_heads
        first_head = get_tensor_model_parallel_rank() * local_heads
        slopes = alibi_slopes(num_heads)[first_head : first_head + local_heads]
        self.attn = Attention(
            local_heads,
            head_dim,
            head_dim**-0.5,
            local_heads,
            attn_backend,
            alibi_slopes=slopes.to(torch.get_default_device()),
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query_key_value(hidden_states).chunk(3, dim=-1)
        return self.dense(self.attn(q, k, v))


class BloomMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, 4 * config.hidden_size, bias=True)
        self.dense_4h_to_h = RowParallelLinear(4 * config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class BloomBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attention = BloomAttention(config, attn_backend)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = BloomMLP(config)
        # Whether the residual stream continues from the normalized input (BLOOM's option).
        self.residual_from_norm = bool(config.apply_residual_connection_post_layernorm)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        residual = normed if self.residual_from_norm else hidden_states
        hidden_states = residual + self.self_attention(normed)
        normed = self.post_attention_layernorm(hidden_states)
        residual = normed if self.residual_from_norm else hidden_states
        return residual + self.mlp(normed)


class BloomModel(nn.Module):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.word_embeddings_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.h = nn.ModuleList(BloomBlock(config, attn_backend) for _ in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """positions are unused: ALiBi reads positions from the cache, inside attention."""
        hidden_states = self.word_embeddings_layernorm(self.word_embeddings(input_ids))
        for block in self.h:
            hidden_states = block(hidden_states)
        return self.ln_f(hidden_states)


class BloomForCausalLM(CausalLM):
    rotary = False  # ALiBi

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.tie_word_embeddings = True
        self.transformer = BloomModel(config, attn_backend)
        self.model = self.transformer
        self.lm_head = self.transformer.word_embeddings
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.num_heads = config.num_attention_heads

    def _checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, str, int | str | None, torch.Tensor]]:
        for ckpt_name, name, shard_id, tensor in super()._checkpoint_tensors(weights):
            # Bare BloomModel checkpoints name the blocks without the "transformer." prefix.
            name = name if name.startswith("transformer.") else f"transformer.{name}"
            if ".query_key_value." in name:
                # [num_heads, 3, head_dim, ...] rows -> [3, num_heads, head_dim, ...]: q | k | v.
                tensor = read_whole(tensor)
                rest = tensor.shape[1:]
                tensor = tensor.view(self.num_heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest)
            yield ckpt_name, name, shard_id, tensor
