"""Qwen3-Next (Qwen3-Next-80B-A3B): Gated DeltaNet layers with a gated full-attention layer every
few (``layer_types``, by default 3 linear then 1 full), as Hugging Face transformers'
``Qwen3NextForCausalLM`` computes it.

* Linear-attention layers: ``GatedDeltaNet`` (layers/linear_attention/), whose per-request conv
  window and recurrent state live in the state cache beside the paged KV (core/state_cache.py).
* Full-attention layers: q and an output gate from one projection (per head [q | gate]), per-head
  zero-centred RMSNorm on q and k, a partial rotary embedding (``partial_rotary_factor``), paged
  attention, then output * sigmoid(gate).
* Every norm is zero-centred, x * (1 + weight) (``GemmaRMSNorm``).
* Feed-forward: sparse MoE (softmax top-k, renormalised when ``norm_topk_prob``) plus a shared
  expert scaled by sigmoid(shared_expert_gate(x)); dense SwiGLU on ``mlp_only_layers``.

Qwen3.5's text models (``Qwen3_5ForCausalLM``, dense SwiGLU everywhere, and
``Qwen3_5MoeForCausalLM``, MoE everywhere) are the same network with the Gated DeltaNet's input
projections kept apart (``split_projections``); their multimodal rotary embedding reduces to the
plain one on text, whose three position components are equal.

Only the full-attention layers have a KV cache (bound to them in order, attention/forward_context.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention import Attention
from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.layers.activation import SigmoidGate
from pagedllm.layers.layernorm import GemmaRMSNorm
from pagedllm.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedllm.layers.linear_attention.gated_deltanet import GatedDeltaNet
from pagedllm.layers.linear_attention.state import LayerStateShape
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from pagedllm.models.llama import LlamaMLP, head_dim, rotary_embedding
from pagedllm.models.moe import MoeForCausalLM, SparseMoeBlock
from pagedllm.models.utils import CausalLM, DecoderModel, make_stage_layers, pre_norm

LINEAR_ATTENTION = "linear_attention"
# Qwen3.5's text model types, whose Gated DeltaNet keeps its four input projections apart.
_SPLIT_PROJECTION_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")


def is_moe_layer(config: PretrainedConfig, layer_index: int) -> bool:
    """Qwen3-Next's rule (``mlp_only_layers``, ``decoder_sparse_step``); Qwen3.5-MoE configs have
    neither (every layer sparse), Qwen3.5's dense ones no experts."""
    if not getattr(config, "num_experts", 0):
        return False
    step = getattr(config, "decoder_sparse_step", 1)
    return (
        layer_index not in (getattr(config, "mlp_only_layers", None) or []) and (layer_index + 1) % step == 0
    )


class Qwen3NextAttention(nn.Module):
    """Full attention with an output gate. ``qkv_proj`` packs q_proj (per head [q | gate], so
    2 * num_heads "heads" of head_dim), k_proj and v_proj."""

    def __init__(
        self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, attn_backend: type[AttentionBackend]
    ) -> None:
        super().__init__()
        self.head_dim = head_dim(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            2 * config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
        )
        self.num_heads = self.qkv_proj.num_heads // 2  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias
        )
        self.output_gate = SigmoidGate()
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        # A partial rotation is applied here (the backends' fused kernels rotate whole heads).
        self.model_rotary = rotary_emb if rotary_emb.is_partial else None
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            attn_backend,
            rotary=None if rotary_emb.is_partial else rotary_emb,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions: [num_tokens]; hidden_states: [num_tokens, hidden_size] -> same shape."""
        n, d = hidden_states.shape[0], self.head_dim
        kv_size = self.num_kv_heads * d
        q_gate, k, v = self.qkv_proj(hidden_states).split([2 * self.num_heads * d, kv_size, kv_size], dim=-1)
        q, gate = q_gate.view(n, self.num_heads, 2 * d).split([d, d], dim=-1)
        q = self.q_norm(q).reshape(n, self.num_heads * d)  # the norm reads the strided view
        k = self.k_norm(k.reshape(n, self.num_kv_heads, d)).view(n, kv_size)
        if self.model_rotary is not None:
            q, k = self.model_rotary(positions, q, k)
        out = self.attn(q, k, v, positions=positions)
        # The gate read where it lies (a strided view): reshaping it first would copy it.
        return self.o_proj(self.output_gate(out.view(n, self.num_heads, d), gate))


class Qwen3NextSparseMoeBlock(SparseMoeBlock):
    """The routed experts plus a shared expert that every token takes, scaled by a sigmoid gate.

    The experts add the shared term themselves (``FusedMoE.forward``: on CUDA in the kernel that
    adds the routed slots). Under tensor parallelism the shared expert's down projection leaves
    its partial sum unreduced: ``sigmoid(gate) * shared`` is linear in it (the gate is replicated),
    so it joins the routed partial sum before the experts' one all-reduce, saving the shared
    expert's own.

    Where the experts run the grouped GEMM, the shared expert becomes experts of it after loading
    (``FusedMoE.absorb_shared_expert``) and its gate a row of the router's weight after the
    experts' (then zero rows): one GEMM routes and gates, and the shared expert's GEMMs and
    activation are the experts' own.
    ``shared_expert`` and ``shared_expert_gate`` are then None."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=getattr(config, "norm_topk_prob", True),  # Qwen3.5-MoE always renormalises
            hidden_act=config.hidden_act,
        )
        self.shared_expert = LlamaMLP(
            config, intermediate_size=config.shared_expert_intermediate_size, reduce_results=False
        )
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False)
        self.shared_expert_gate.quantizable = False

    def process_weights_after_loading(self) -> None:
        """Absorb the shared expert into the experts where they can run it (the model loader calls
        this once the weights are loaded)."""
        shared = self.shared_expert
        if shared.gate_up_proj.quant_method is not None or shared.down_proj.quant_method is not None:
            return
        if not self.experts.can_absorb_shared_expert(shared.down_proj.weight.shape[1]):
            return
        self.experts.absorb_shared_expert(
            shared.gate_up_proj.weight, shared.down_proj.weight, gate_in_logits=True
        )
        # Rows padded to a multiple of 16: cuBLAS ran E + 1 of them (17 at W6's config, on an
        # H200) as a split-K CUTLASS GEMM and two reductions, three kernels for 70 KB of weights.
        router = self.gate.weight
        padding = router.new_zeros(-(router.shape[0] + 1) % 16, router.shape[1])
        router = torch.cat([router, self.shared_expert_gate.weight, padding])
        self.gate.weight = nn.Parameter(router, requires_grad=False)
        self.gate.output_sizes = [router.shape[0]]
        self.shared_expert = self.shared_expert_gate = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_tokens, hidden_size] -> same shape."""
        if self.shared_expert is None:  # absorbed: the router's logits carry its gate
            return self.experts(hidden_states, self.gate(hidden_states))
        return self.experts(
            hidden_states,
            self.gate(hidden_states),
            shared=self.shared_expert(hidden_states),
            shared_gate=self.shared_expert_gate(hidden_states),
        )


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_index: int,
        rotary_emb: RotaryEmbedding,
        attn_backend: type[AttentionBackend],
    ) -> None:
        super().__init__()
        self.is_linear = config.layer_types[layer_index] == LINEAR_ATTENTION
        if self.is_linear:
            split = config.model_type in _SPLIT_PROJECTION_TYPES
            self.linear_attn = GatedDeltaNet.from_config(config, split_projections=split)
        else:
            self.self_attn = Qwen3NextAttention(config, rotary_emb, attn_backend)
        self.mlp = (
            Qwen3NextSparseMoeBlock(config)
            if is_moe_layer(config, layer_index)
            else LlamaMLP(config, intermediate_size=config.intermediate_size)
        )
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states, residual: [num_tokens, hidden_size]. Returns (block output, residual
        stream), the residual add deferred to the next norm."""
        hidden_states, residual = pre_norm(self.input_layernorm, hidden_states, residual)
        if self.is_linear:
            hidden_states = self.linear_attn(hidden_states)
        else:
            hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3NextModel(DecoderModel):
    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = rotary_embedding(config)
        self.layers = make_stage_layers(
            config.num_hidden_layers, lambda i: Qwen3NextDecoderLayer(config, i, rotary_emb, attn_backend)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3NextForCausalLM(MoeForCausalLM):
    """Loads as the Llama family's MoE members do (packed q/k/v and gate/up, stacked experts)."""

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        CausalLM.__init__(self)
        self.model = Qwen3NextModel(config, attn_backend)
        self.init_lm_head(config, self.model.embed_tokens)

    # --- the hybrid model's interface (worker/state_cache.py) -----------------------------------

    @staticmethod
    def num_attention_layers(config: PretrainedConfig, layers: range | None = None) -> int:
        """Layers with a paged KV cache (among ``layers``, a pipeline stage's; all when None)."""
        kinds = config.layer_types
        return sum(kinds[i] != LINEAR_ATTENTION for i in (range(len(kinds)) if layers is None else layers))

    @staticmethod
    def state_shapes(
        config: PretrainedConfig, tp_size: int, layers: range | None = None
    ) -> list[LayerStateShape]:
        """Each linear-attention layer's state per request on one rank (among ``layers``), in
        layer order."""
        shape = GatedDeltaNet.state_shape_of(config, tp_size)
        kinds = config.layer_types
        return [
            shape for i in (range(len(kinds)) if layers is None else layers) if kinds[i] == LINEAR_ATTENTION
        ]

    def linear_attention_layers(self) -> Iterator[GatedDeltaNet]:
        return (layer.linear_attn for layer in self.model.stage_layers if layer.is_linear)
