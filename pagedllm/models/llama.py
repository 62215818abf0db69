"""The Llama family: Llama (SmolLM2 included), Mistral, Qwen2 and Qwen3, in one implementation.

They share the decoder block (pre-norm RMSNorm, rotary attention with grouped KV heads, SwiGLU
MLP) and differ in a few switches read from the config:

* Qwen2: bias on q/k/v, none on o_proj.
* Qwen3: RMSNorm over each head's q and k (``q_norm``, ``k_norm``) before the rotary embedding.
* Llama: ``attention_bias`` (q/k/v and o) and ``mlp_bias``.
* Mistral: a sliding window on every layer; Qwen2/Qwen3: on the layers that ``layer_types`` (from
  ``use_sliding_window`` and ``max_window_layers``) marks as sliding (``layer_sliding_windows``).
* Phi-3 (Phi-3.5, Phi-4-mini): checkpoints store q/k/v and gate/up packed already (our
  ``qkv_proj``/``gate_up_proj``) and may rotate part of each head (``partial_rotary_factor``).
* SmolLM3: no rotary embedding on the layers ``no_rope_layers`` marks 0 (NoPE).

OLMo-2 and EXAONE-4 (``olmo2.py``) swap the decoder layer for a post-norm one; Gemma 2/3
(``gemma.py``) for a sandwich-norm one. Each family picks its layer (``decoder_layer``), its
feed-forward block (``make_mlp``) and which layers rotate (``uses_rope``).

The file reads as single-device code: tensor parallelism lives in the linear layers, which hold
this rank's heads and features, and in their weight loaders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention import Attention
from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.distributed import get_pipeline_model_parallel_world_size, reductions_in_norms
from pagedllm.layers.activation import GeluAndMul, SiluAndMul
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.rotary_embedding import RotaryEmbedding, get_rope_parameters
from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from pagedllm.models.utils import (
    CausalLM,
    DecoderModel,
    attention_sinks,
    layer_sliding_windows,
    make_stage_layers,
    pre_norm,
)


@dataclass(frozen=True)
class AttentionOptions:
    """The per-family switches of the attention block."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    # Softmax scale; None: head_dim ** -0.5.
    scale: float | None = None
    logits_soft_cap: float | None = None
    # The norm over each head's q and k when qk_norm (Gemma's adds 1 to its weight).
    norm_class: type[RMSNorm] = RMSNorm
    # qk_norm over each head (Qwen3, Gemma 3), or over the whole q and k projections (OLMo-2).
    qk_norm_per_head: bool = True
    # A learned sink logit per head in every softmax (gpt-oss's ``sinks``).
    learned_sinks: bool = False

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> AttentionOptions:
        model_type = config.model_type
        if model_type == "qwen2":
            return cls(qkv_bias=True, o_bias=False, qk_norm=False)
        bias = getattr(config, "attention_bias", False)
        return cls(
            qkv_bias=bias,
            o_bias=bias and model_type not in _NO_O_BIAS_FAMILIES,
            qk_norm=model_type in _QK_NORM_FAMILIES or bool(getattr(config, "use_qk_norm", False)),
            qk_norm_per_head=model_type != "olmo2",
            learned_sinks=model_type == "gpt_oss",
        )


# Families whose q and k are RMS-normalized before the rotation (GLM-4-MoE: when use_qk_norm).
_QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "olmo2", "exaone4")
# Families whose attention_bias is on q/k/v only.
_NO_O_BIAS_FAMILIES = ("glm4_moe",)


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_embedding(
    config: PretrainedConfig, rope_parameters: dict[str, Any] | None = None, unbounded: bool = False
) -> RotaryEmbedding:
    """The cos/sin table of the config's heads (``rope_parameters``: the config's own when None);
    ``unbounded``: positions may pass max_position_embeddings (attention sinks)."""
    return RotaryEmbedding(
        head_dim(config),
        config.max_position_embeddings,
        rope_parameters or get_rope_parameters(config),
        torch.get_default_dtype(),
        unbounded=unbounded,
    )


# Gated MLP activations by the config's name for them.
_GATED_ACTIVATIONS: dict[str, type[nn.Module]] = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluAndMul}


class LlamaMLP(nn.Module):
    """SwiGLU (or another gated activation): ``down(act(gate(x)) * up(x))``. ``reduce_results``:
    as RowParallelLinear's, for a caller that folds the down projection's partial sums into its
    own all-reduce (Qwen3-Next's shared expert)."""

    def __init__(
        self,
        config: PretrainedConfig,
        hidden_act: str | None = None,
        intermediate_size: int | None = None,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        hidden_act = hidden_act or config.hidden_act
        intermediate_size = intermediate_size or config.intermediate_size
        if hidden_act not in _GATED_ACTIVATIONS:
            raise ValueError(
                f"hidden_act {hidden_act!r} is not supported; supported: {sorted(_GATED_ACTIVATIONS)}"
            )
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(
            intermediate_size, config.hidden_size, bias=bias, reduce_results=reduce_results
        )
        self.act_fn = _GATED_ACTIVATIONS[hidden_act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        rotary_emb: RotaryEmbedding | None,
        attn_backend: type[AttentionBackend],
        sliding_window: int | None = None,
        options: AttentionOptions | None = None,
    ) -> None:
        super().__init__()
        options = options or AttentionOptions.from_config(config)
        self.head_dim = head_dim(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            bias=options.qkv_bias,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=options.o_bias
        )
        # This rank's heads.
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = num_heads * self.head_dim
        self.kv_size = num_kv_heads * self.head_dim
        self.q_norm = self.k_norm = None
        if options.qk_norm:
            self.qk_norm_per_head = options.qk_norm_per_head
            q_dim, k_dim = (self.head_dim, self.head_dim) if self.qk_norm_per_head else self._full_qk_sizes()
            self.q_norm = options.norm_class(q_dim, config.rms_norm_eps)
            self.k_norm = options.norm_class(k_dim, config.rms_norm_eps)
        # None: a NoPE layer (no positions in q and k). A partial rotation (part of each head) is
        # applied here, since the backends' fused kernels rotate whole heads; a whole-head one is
        # the backend's to apply or fuse.
        self.rotary_emb = rotary_emb
        self.model_rotary = rotary_emb if rotary_emb is not None and rotary_emb.is_partial else None
        backend_rotary = rotary_emb if self.model_rotary is None else None
        # With attention sinks (StreamingLLM), keys are cached rotated at their own positions, so
        # distances within the window are the true ones; a sink must sit where StreamingLLM's
        # cache puts the query, at most num_sinks + window - 1 past it. The sinks' scores
        # therefore use the query rotated once more, to min(position, num_sinks + window - 1):
        # one extra rotation of the query instead of re-rotating cached keys as the window moves.
        self.num_sinks = attention_sinks(config)
        self.max_sink_distance = self.num_sinks + (sliding_window or 0) - 1
        scale = options.scale if options.scale is not None else self.head_dim**-0.5
        self.sinks = None
        if options.learned_sinks:  # this rank's heads
            self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
            self.sinks.weight_loader = self.qkv_proj.head_weight_loader
        self.attn = Attention(
            num_heads,
            self.head_dim,
            scale,
            num_kv_heads,
            attn_backend,
            sliding_window=sliding_window,
            logits_soft_cap=options.logits_soft_cap,
            attention_sinks=self.num_sinks,
            rotary=backend_rotary,
            sinks=self.sinks,
        )

    def _full_qk_sizes(self) -> tuple[int, int]:
        """(q, k) widths of an OLMo-2 norm over the whole projections, which every head's values
        enter: with heads split across ranks, the sum of squares would need an all-reduce."""
        if self.qkv_proj.tp_size > 1:
            raise ValueError(
                "a q/k norm over the whole projection (OLMo-2) is not supported with tensor_parallel_size > 1"
            )
        return self.q_size, self.kv_size

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions: [num_tokens]; hidden_states: [num_tokens, hidden_size] -> same shape."""
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q, k = self._norm_heads(q, k) if self.qk_norm_per_head else (self.q_norm(q), self.k_norm(k))
        sink_q = None
        if self.num_sinks:
            sink_q = (
                q
                if self.rotary_emb is None
                else self.rotary_emb.rotate_query(positions.clamp(max=self.max_sink_distance), q)
            )
        if self.model_rotary is not None:  # in place (the Triton kernel) or new tensors (torch)
            q, k = self.model_rotary(positions, q, k)
        # The backend rotates q and k to their positions (or fuses the rotation into its cache write).
        return self.o_proj(self.attn(q, k, v, sink_query=sink_q, positions=positions))

    def _norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's per-head RMSNorm. q: [num_tokens, q_size]; k: [num_tokens, kv_size]."""
        num_tokens = q.shape[0]
        q = self.q_norm(q.view(num_tokens, -1, self.head_dim)).view(num_tokens, self.q_size)
        k = self.k_norm(k.view(num_tokens, -1, self.head_dim)).view(num_tokens, self.kv_size)
        return q, k


class LlamaDecoderLayer(nn.Module):
    # The attention block: __init__(config, rotary_emb, attn_backend, sliding_window).
    attention_class: type[nn.Module] = LlamaAttention

    def __init__(
        self,
        config: PretrainedConfig,
        rotary_emb: RotaryEmbedding | None,
        attn_backend: type[AttentionBackend],
        sliding_window: int | None,
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, rotary_emb, attn_backend, sliding_window)
        self.mlp = mlp  # LlamaMLP, or a mixture of experts (models/moe.py): [num_tokens, hidden] -> same
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states, residual: [num_tokens, hidden_size]. The residual add of each block is
        deferred to the next norm, which fuses it; returns (block output, residual stream)."""
        hidden_states, residual = pre_norm(self.input_layernorm, hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def can_defer_reductions(self) -> bool:
        """Whether both blocks end in a row-parallel projection this layer's forward hands
        straight to a norm (a subclass's forward, MLA's attention or a mixture of experts may not)."""
        return (
            type(self) is LlamaDecoderLayer
            and type(self.self_attn) is LlamaAttention
            and type(self.mlp) is LlamaMLP
        )

    def defer_reductions(self, reduce_input: bool) -> None:
        """Leave the o and down projections' all-reduces to the norms that follow them: the
        post-attention norm, and the next layer's input norm (``reduce_input`` on that layer) or
        the model's final norm. The block outputs are then this rank's partial sums."""
        self.self_attn.o_proj.reduce_results = False
        self.mlp.down_proj.reduce_results = False
        self.post_attention_layernorm.reduce_partial_input()
        if reduce_input:
            self.input_layernorm.reduce_partial_input()


def defer_reductions_to_norms(layers: nn.ModuleList, norm: nn.Module) -> None:
    """Under tensor parallelism, fold every layer's two all-reduces into the norm after each
    (``RMSNorm.reduce_partial_input``: one kernel for the all-reduce, the residual add and the
    norm on GPUs that share memory) when every layer can (``can_defer_reductions``), with one
    pipeline stage (a stage's output would cross to the next one unsummed) and nothing reading a
    layer's output before its norm (``reductions_in_norms``)."""
    if not reductions_in_norms() or get_pipeline_model_parallel_world_size() > 1:
        return
    if not all(isinstance(layer, LlamaDecoderLayer) and layer.can_defer_reductions() for layer in layers):
        return
    for i, layer in enumerate(layers):
        layer.defer_reductions(reduce_input=i > 0)  # the first layer's input is the embedding's, whole
    norm.reduce_partial_input()


# make_layer(config, layer_index, rotary_emb, attn_backend, sliding_window): one decoder layer.
MakeLayer = Callable[[PretrainedConfig, int, RotaryEmbedding, type[AttentionBackend], int | None], nn.Module]


class LlamaModel(DecoderModel):
    def __init__(
        self, config: PretrainedConfig, attn_backend: type[AttentionBackend], make_layer: MakeLayer
    ) -> None:
        """make_layer builds each decoder layer: forward(positions, hidden_states, residual) ->
        (hidden_states, residual), the stream being their sum."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One cos/sin cache shared by every layer: it is the same table, and can be large.
        rotary_emb = rotary_embedding(config, unbounded=attention_sinks(config) > 0)
        windows = layer_sliding_windows(config)
        self.layers = make_stage_layers(
            len(windows), lambda i: make_layer(config, i, rotary_emb, attn_backend, windows[i])
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        defer_reductions_to_norms(self.layers, self.norm)


class LlamaForCausalLM(CausalLM):
    """The engine's model interface (``CausalLM``) over the Llama decoder."""

    packed_modules_mapping: ClassVar[dict[str, tuple[tuple[str, int | str], ...]]] = {
        "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
        "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
    }
    # inv_freq is a buffer older checkpoints saved; we derive it from the config.
    skipped_checkpoint_names = ("rotary_emb.inv_freq",)
    # The decoder layer: __init__(config, rotary_emb, attn_backend, sliding_window, mlp).
    decoder_layer: ClassVar[type[nn.Module]] = LlamaDecoderLayer
    supports_pipeline_parallel: ClassVar[bool] = True

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.model = LlamaModel(config, attn_backend, self.make_layer)
        self.init_lm_head(config, self.model.embed_tokens)

    def make_layer(
        self,
        config: PretrainedConfig,
        layer_index: int,
        rotary_emb: RotaryEmbedding,
        attn_backend: type[AttentionBackend],
        sliding_window: int | None,
    ) -> nn.Module:
        rotary = rotary_emb if self.uses_rope(config, layer_index) else None
        mlp = self.make_mlp(config, layer_index)
        return self.decoder_layer(config, rotary, attn_backend, sliding_window, mlp)

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_index: int) -> nn.Module:
        """The feed-forward block of layer ``layer_index``: the SwiGLU MLP in every layer here;
        mixture-of-experts subclasses choose per layer."""
        return LlamaMLP(config)

    @staticmethod
    def uses_rope(config: PretrainedConfig, layer_index: int) -> bool:
        """Whether layer ``layer_index`` rotates q and k: all but those SmolLM3's
        ``no_rope_layers`` marks 0 (NoPE layers)."""
        no_rope_layers = getattr(config, "no_rope_layers", None)
        return no_rope_layers is None or bool(no_rope_layers[layer_index])
