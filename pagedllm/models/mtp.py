"""The multi-token-prediction layer of DeepSeek-V3 and GLM-4.5 as a draft head (speculative_config
method ``"mtp"``), loaded from the target's own checkpoint as vLLM loads it (``deepseek_mtp.py``).

DeepSeek-V3 (DeepSeek-AI 2024, section 2.2) trains, beside its decoder, a module that predicts one
token further: at position p it reads the target's final hidden state at p and the embedding of
the token at p + 1, and predicts the token at p + 2, the EAGLE head's contract
(models/llama_eagle.py), so the worker runs it as one (worker/eagle.py)::

    x      = eh_proj(concat(enorm(embed(token p + 1)), hnorm(hidden p)))     [num_tokens, hidden]
    stream = x + block(x)                      one decoder layer of the target's kind (MLA, MoE)
    logits = shared_head.head(shared_head.norm(stream))

``stream`` (before the norm) is what its next step reads in place of the target's hidden state,
as vLLM chains it for k > 1 drafts from one layer. The checkpoint stores it as decoder layer
``num_hidden_layers`` (``model.layers.61.`` in DeepSeek-V3's): ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.{norm,head}``, optionally ``embed_tokens`` (the target's otherwise), and the block's
own tensors (``self_attn.``, ``mlp.``, the two norms), which load through the target class's own
names (its packed and expert projections). A checkpoint with more than one such layer drafts from
the first. As in vLLM, the embedding at position 0 is zeroed (the module never saw one there).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import cache

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.vocab_parallel_embedding import ParallelLMHead
from pagedllm.models.llama import LlamaForCausalLM, rotary_embedding
from pagedllm.models.llama_eagle import EagleHead

# The head's own tensors under the layer's prefix (the rest is its decoder block's): checkpoint
# name -> parameter name.
_HEAD_NAMES = {
    "enorm.": "enorm.",
    "hnorm.": "hnorm.",
    "eh_proj.": "eh_proj.",
    "shared_head.norm.": "norm.",
    "shared_head.head.": "lm_head.",
    "embed_tokens.": "embed_tokens.",
}


def mtp_layer_index(config: PretrainedConfig) -> int:
    """The checkpoint's layer number of the (first) multi-token-prediction layer."""
    return getattr(config, "mtp_layer_index", config.num_hidden_layers)


class MultiTokenPredictor(EagleHead):
    """The MTP layer, mixed with its target's class by ``mtp_head_class``: the target class's
    ``make_layer`` builds the block as the target's layer ``mtp_layer_index`` would be, and its
    ``_param_name`` names the block's checkpoint tensors."""

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        # Not super().__init__: the target class follows in the MRO, and its __init__ builds the
        # whole model.
        nn.Module.__init__(self)
        self._init_embeddings(config)
        hidden = config.hidden_size
        self.layer_index = mtp_layer_index(config)
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, bias=False)
        self.mtp_block = self.make_layer(
            config, self.layer_index, rotary_embedding(config), attn_backend, None
        )
        self.decoder_layers = nn.ModuleList([self.mtp_block])
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, hidden)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.loaded_lm_head = False

    def forward(  # type: ignore[override]
        self, input_embeds: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # vLLM's deepseek_mtp zeroes the embedding at position 0 (a tensor op: graphs capture it).
        input_embeds = input_embeds * (positions != 0).unsqueeze(-1).to(input_embeds.dtype)
        return super().forward(input_embeds, positions, hidden_states)

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1)), None

    def finish(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(shared_head.norm(x + residual), x + residual)."""
        return self.norm(x, residual)

    def _checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, str, int | str | None, torch.Tensor]]:
        """This layer's tensors only (the target's checkpoint holds the whole model), named as the
        head's parameters; the block's through the target class's names."""
        prefix = f"model.layers.{self.layer_index}."
        for ckpt_name, tensor in weights:
            if not ckpt_name.startswith(prefix) or "rotary_emb.inv_freq" in ckpt_name:
                continue
            local = ckpt_name.removeprefix(prefix)
            theirs = next((name for name in _HEAD_NAMES if local.startswith(name)), None)
            if theirs is not None:
                head = _HEAD_NAMES[theirs] + local[len(theirs) :]
                self.loaded_embeddings |= head.startswith("embed_tokens.")
                self.loaded_lm_head |= head.startswith("lm_head.")
                yield ckpt_name, head, None, tensor
            else:
                yield ckpt_name, *self._param_name(f"mtp_block.{local}"), tensor

    def _describe_missing(self, name: str, loaded: set[int | str | None]) -> str | None:
        if name.startswith("lm_head."):  # the target's then
            return None
        return super()._describe_missing(name, loaded)


@cache
def mtp_head_class(target_class: type[LlamaForCausalLM]) -> type[MultiTokenPredictor]:
    """The head class for a target class that stores MTP layers (DeepSeek-V3, GLM-4-MoE): its
    layers and checkpoint names come from the target class (``make_layer``, ``_param_name``)."""

    return type(
        f"{target_class.__name__}MTP",
        (MultiTokenPredictor, target_class),
        # EagleHead's (Llama's) packing would pack MLA's q_proj into a qkv_proj.
        {"packed_modules_mapping": target_class.packed_modules_mapping},
    )
