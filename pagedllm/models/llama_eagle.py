"""EAGLE draft heads for Llama-family targets (speculative_config method "eagle" and "eagle3"),
in the layout of the public checkpoints (SafeAILab/EAGLE, the ``yuhuili/EAGLE*`` repositories),
loaded as vLLM loads them (``llama_eagle.py``, ``llama_eagle3.py``).

An EAGLE head is one (or a few) decoder layers that continue the TARGET's hidden states instead of
its own: the head at position p reads the token at p + 1 and the target's hidden state at p, and
predicts the token at p + 2 (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty"). Its later steps read its own output in place of the target's.

* **EAGLE-3** (Li et al. 2025): the target's hidden states from three layers, concatenated
  ([num_tokens, 3 * hidden]), are fused by ``fc`` to [num_tokens, hidden]; one decoder layer,
  ``midlayer``, whose q/k/v read concat(input_layernorm(embed(token)), hidden_norm(hidden))
  ([num_tokens, 2 * hidden]); ``norm``; its own ``lm_head`` over a draft vocabulary of
  ``draft_vocab_size`` tokens (often 32k of the target's 128k), mapped back by ``d2t``:
  target id = draft id + d2t[draft id] (``t2d``, the inverse mask, is not needed to draft).
* **EAGLE** (EAGLE-1): ``fc`` over concat(embed(token), hidden) of the target's LAST hidden state
  (after its final norm), then decoder layers (the first without its input norm), no final norm:
  the target's own LM head scores the output.

The embeddings are the target's unless the checkpoint has its own (``embed_tokens``); the worker
(worker/eagle.py) chooses once, after loading, and hands the heads embeddings, not token ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import QKVParallelLinear, ReplicatedLinear
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.rotary_embedding import RotaryEmbedding, get_rope_parameters
from pagedllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, head_dim
from pagedllm.models.utils import CausalLM, read_whole


def eagle3_aux_layer_ids(config: PretrainedConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose INPUT (the residual stream after the layer before) EAGLE-3 reads:
    the head config's ``eagle_aux_hidden_state_layer_ids``, else vLLM's default (2, L // 2, L - 3)."""
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    if ids is None:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    return tuple(int(i) for i in ids)


def _rotary(config: PretrainedConfig) -> RotaryEmbedding:
    rope = get_rope_parameters(config)
    return RotaryEmbedding(head_dim(config), config.max_position_embeddings, rope, torch.get_default_dtype())


class EagleHead(CausalLM):
    """What both heads share: the step (``forward``), and loading the public layout (optionally
    under ``model.``, with or without ``embed_tokens``).

    A head fuses the token's embedding with the hidden state it continues (``fuse``), runs its
    decoder layers and finishes (``finish``) into (hidden for the LM head, hidden for the next
    step). Subclasses set ``decoder_layers``: forward(positions, x, residual) -> (x, residual), their
    attention reading its bound KV cache and the step's forward context.
    """

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    skipped_checkpoint_names = ("rotary_emb.inv_freq", "t2d")
    decoder_layers: nn.ModuleList

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self._init_embeddings(config)

    def _init_embeddings(self, config: PretrainedConfig) -> None:
        # Dropped by the worker, which then embeds with the target's, when the checkpoint has none.
        self.embed_tokens: VocabParallelEmbedding | None = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size
        )
        self.loaded_embeddings = False

    def forward(  # type: ignore[override]
        self,
        input_embeds: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_embeds: [num_tokens, hidden] of the tokens; hidden_states: [num_tokens, hidden]
        (``combine_hidden_states`` of the target's, or the head's own second output)."""
        x, residual = self.fuse(input_embeds, hidden_states)
        for layer in self.decoder_layers:
            x, residual = layer(positions, x, residual)
        return self.finish(x, residual)

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[num_tokens, hidden] each -> (the first layer's input, the residual stream or None)."""
        raise NotImplementedError

    def finish(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's (output, residual) -> (hidden for the LM head, for the next step)."""
        raise NotImplementedError

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's hidden states as the head's first step reads them (identity here)."""
        return hidden_states

    def _checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, str, int | str | None, torch.Tensor]]:
        for ckpt_name, name, shard_id, tensor in super()._checkpoint_tensors(weights):
            name = name.removeprefix("model.")
            self.loaded_embeddings |= name.startswith("embed_tokens.")
            yield ckpt_name, name, shard_id, tensor

    def _describe_missing(self, name: str, loaded: set[int | str | None]) -> str | None:
        if name.startswith("embed_tokens."):  # the target's then
            return None
        return super()._describe_missing(name, loaded)


class Eagle3DecoderLayer(nn.Module):
    """EAGLE-3's ``midlayer``: a Llama decoder layer whose attention reads the token's embedding
    and the hidden state side by side (q/k/v over 2 * hidden_size inputs)."""

    def __init__(
        self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, attn_backend: type[AttentionBackend]
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.self_attn = LlamaAttention(config, rotary_emb, attn_backend)
        attn = self.self_attn
        attn.qkv_proj = QKVParallelLinear(
            2 * hidden,
            attn.head_dim,
            config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            bias=bool(getattr(config, "attention_bias", False)),
        )
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        # Some checkpoints start the residual stream from the normed hidden state (vLLM's key).
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """([num_tokens, 2 * hidden] concat(input_layernorm(embeds), hidden_norm(hidden)), the
        residual stream: ``hidden``, or its normed form with ``norm_before_residual``)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [num_tokens, 2 * hidden] (``attention_input``) -> (block output, residual stream)."""
        out = self.self_attn(positions, x)
        out, residual = self.post_attention_layernorm(out, residual)
        return self.mlp(out), residual


class Eagle3LlamaForCausalLM(EagleHead):
    """The EAGLE-3 head (``LlamaForCausalLMEagle3`` checkpoints): fc, midlayer, norm, lm_head, d2t."""

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.fc = ReplicatedLinear(3 * hidden, hidden, bias=False)
        self.midlayer = Eagle3DecoderLayer(config, _rotary(config), attn_backend)
        self.decoder_layers = nn.ModuleList([self.midlayer])
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden)
        self.logits_processor = LogitsProcessor(self.draft_vocab_size)
        # [draft_vocab] int64: target id - draft id. Zeros (no d2t in the checkpoint): the same ids.
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_tokens, 3 * hidden] (three target layers) -> [num_tokens, hidden]."""
        return self.fc(hidden_states)

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.midlayer.attention_input(embeds, hidden)

    def finish(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        return self.norm(x, residual)

    def draft_token_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [num_rows, draft_vocab] -> [num_rows] greedy drafts as TARGET ids."""
        draft_ids = logits.argmax(dim=-1)
        return draft_ids + self.d2t[draft_ids]

    def _checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, str, int | str | None, torch.Tensor]]:
        for ckpt_name, name, shard_id, tensor in super()._checkpoint_tensors(weights):
            if name == "d2t":  # a buffer, not a parameter
                self.d2t.copy_(read_whole(tensor))
                continue
            yield ckpt_name, name, shard_id, tensor


class EagleLlamaForCausalLM(EagleHead):
    """The EAGLE(-1) head: fc over concat(embed, hidden), decoder layers (the first without its
    input norm, as SafeAILab's ``cnets.py``), no final norm; the target's LM head scores it."""

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=False)
        rotary = _rotary(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, attn_backend, None, LlamaMLP(config))
            for _ in range(config.num_hidden_layers)
        )
        self.layers[0].input_layernorm = nn.Identity()
        self.decoder_layers = self.layers

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.fc(torch.cat([embeds, hidden], dim=-1)), None

    def finish(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = x + residual
        return out, out
