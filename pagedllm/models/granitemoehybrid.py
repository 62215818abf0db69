"""IBM Granite 4.0-H (``GraniteMoeHybridForCausalLM``) and its forerunner Bamba
(``BambaForCausalLM``): Mamba-2 hybrids, as Hugging Face transformers computes them.

Every layer is two pre-norm residual blocks: a mixer that ``layer_types`` names, Mamba-2
(``linear_attention``, layers/linear_attention/mamba2.py, its state in the state cache beside
the paged KV) or grouped-query attention (``full_attention``, rotary only where
``position_embedding_type`` is ``"rope"``: Granite 4.0-H's layers have no positions, the Mamba-2
layers carry order); then a feed-forward block, top-k routed SwiGLU experts (softmax over the k
chosen logits) plus an always-on shared SwiGLU MLP, or the shared MLP alone when the config has
no experts. Granite's scalings: the embeddings times ``embedding_multiplier``, each block's output
times ``residual_multiplier`` before its residual add, attention scores times
``attention_multiplier`` (in place of head_dim ** -0.5), the logits divided by
``logits_scaling``.

Checkpoints store each MoE's experts stacked (``block_sparse_moe.input_linear`` [E, 2I, H], gate
rows then up rows; ``output_linear`` [E, H, I]; ``router.layer``), and the shared MLP's gate and
up projections as one ``input_linear``.

Bamba is the dense case with every scaling 1 and rotary attention (on part of each head,
``partial_rotary_factor``): its ``feed_forward`` MLP (gate, up, down), ``pre_ff_layernorm`` and
``final_layernorm`` load as the shared MLP, the post-mixer norm and the final norm.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedllm.layers.linear_attention.mamba2 import Mamba2Mixer, Mamba2Spec
from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from pagedllm.models.llama import AttentionOptions, LlamaAttention, rotary_embedding
from pagedllm.models.mamba2_hybrid import ATTENTION, MAMBA, Mamba2HybridForCausalLM
from pagedllm.models.utils import DecoderModel, make_stage_layers, pre_norm

# Checkpoint names -> ours (the stacked experts are whole parameters, loaded whole). Also
# transformers' in-memory names (``experts.gate_up_proj``, ``router.weight``), which a tool saving
# its state dict as it stands would write.
_RENAMES = (
    (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
    (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
    (".block_sparse_moe.router.layer.", ".block_sparse_moe.gate."),
    (".block_sparse_moe.router.weight", ".block_sparse_moe.gate.weight"),
    (".shared_mlp.input_linear.", ".shared_mlp.gate_up_proj."),
    (".shared_mlp.output_linear.", ".shared_mlp.down_proj."),
)


def _check_activation(config: PretrainedConfig) -> None:
    if config.hidden_act != "silu":
        raise ValueError(
            f"hidden_act must be 'silu' (SwiGLU experts and shared MLP), got {config.hidden_act!r}"
        )


class GraniteSharedMLP(nn.Module):
    """gate_up (one checkpoint tensor, gate rows then up rows), SiLU-and-multiply, down."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GraniteMoeBlock(nn.Module):
    """Routed experts (softmax over the top-k logits: the renormalised softmax of all of them)
    plus the shared MLP."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=False)
        self.gate.quantizable = False  # routers stay dense in quantized checkpoints (as in vLLM)
        self.experts = FusedMoE(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


class GraniteMoeHybridLayer(nn.Module):
    def __init__(
        self, config: PretrainedConfig, layer_index: int, attn_backend: type[AttentionBackend]
    ) -> None:
        super().__init__()
        self.block_type = config.layer_types[layer_index]
        # One of the two, named as the checkpoint names it.
        self.mamba = self.self_attn = None
        if self.block_type == MAMBA:
            self.mamba = Mamba2Mixer(Mamba2Spec.from_granite(config))
        elif self.block_type == ATTENTION:
            rope = getattr(config, "position_embedding_type", "rope") == "rope"  # Bamba's: always
            options = AttentionOptions(
                qkv_bias=config.attention_bias,
                o_bias=config.attention_bias,
                qk_norm=False,
                scale=getattr(config, "attention_multiplier", None),  # None: head_dim ** -0.5
            )
            self.self_attn = LlamaAttention(
                config, rotary_embedding(config) if rope else None, attn_backend, options=options
            )
        else:
            raise ValueError(
                f"layer_types[{layer_index}] is {self.block_type!r}; supported: {[MAMBA, ATTENTION]}"
            )
        experts = getattr(config, "num_local_experts", 0) > 0
        self.block_sparse_moe = GraniteMoeBlock(config) if experts else None
        # Bamba's MLP is intermediate_size wide (Granite's intermediate_size is an expert's).
        width = getattr(config, "shared_intermediate_size", None) or config.intermediate_size
        self.shared_mlp = GraniteSharedMLP(config.hidden_size, width)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = getattr(config, "residual_multiplier", 1.0)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (block output, residual stream), the residual add deferred to the next norm; each
        block's output is scaled by ``residual_multiplier`` first, as Granite adds it."""
        hidden_states, residual = pre_norm(self.input_layernorm, hidden_states, residual)
        if self.mamba is not None:
            hidden_states = self.mamba(hidden_states)
        else:
            hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(
            hidden_states * self.residual_multiplier, residual
        )
        out = self.shared_mlp(hidden_states)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(hidden_states) + out
        return out * self.residual_multiplier, residual


class GraniteMoeHybridModel(DecoderModel):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = getattr(config, "embedding_multiplier", None)
        self.layers = make_stage_layers(
            config.num_hidden_layers, lambda i: GraniteMoeHybridLayer(config, i, attn_backend)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GraniteMoeHybridForCausalLM(Mamba2HybridForCausalLM):
    # Granite 4.0-H's attention has no positions (rotary only where a config asks): the engine's
    # sliding window and attention sinks, which re-position rotary keys, are refused.
    rotary: ClassVar[bool] = False
    mixer_name: ClassVar[str] = "mamba"
    mamba2_spec = staticmethod(Mamba2Spec.from_granite)
    packed_modules_mapping: ClassVar[dict[str, tuple[tuple[str, int | str], ...]]] = {
        "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    }

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        _check_activation(config)
        self.logits_scaling = getattr(config, "logits_scaling", 1.0)
        self.model = GraniteMoeHybridModel(config, attn_backend)
        self.init_lm_head(config, self.model.embed_tokens)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) / self.logits_scaling

    def _param_name(self, ckpt_name: str) -> tuple[str, int | str | None]:
        for ckpt_part, part in _RENAMES:
            if ckpt_part in ckpt_name:
                return ckpt_name.replace(ckpt_part, part), None
        return super()._param_name(ckpt_name)


# Bamba's checkpoint names -> Granite's (then ours, as above).
_BAMBA_RENAMES = (
    (".feed_forward.gate_proj.", ".shared_mlp.gate_up_proj.", 0),
    (".feed_forward.up_proj.", ".shared_mlp.gate_up_proj.", 1),
    (".feed_forward.down_proj.", ".shared_mlp.down_proj.", None),
    (".pre_ff_layernorm.", ".post_attention_layernorm.", None),
    ("model.final_layernorm.", "model.norm.", None),
)


class BambaForCausalLM(GraniteMoeHybridForCausalLM):
    rotary: ClassVar[bool] = True

    def _param_name(self, ckpt_name: str) -> tuple[str, int | str | None]:
        for ckpt_part, part, shard_id in _BAMBA_RENAMES:
            if ckpt_part in ckpt_name:
                return ckpt_name.replace(ckpt_part, part), shard_id
        return super()._param_name(ckpt_name)
