"""The physical floor of an offline mixture-of-experts workload (W5, W7): the least time the
device needs to read what the run must read and compute what it must compute.

* Decode: each step reads the dense weights (attention, routers, shared experts, LM head, dense
  MLPs) and, per sparse layer, the routed experts the batch's tokens touch. With uniform routing a
  batch of ``B`` tokens touches ``E * (1 - (1 - k / E) ** B)`` distinct experts in expectation
  (each expert is missed by one token with probability ``1 - k / E``). The batch is
  ``min(requests left, max_num_seqs)``: requests decode in waves of the run's largest batch, each
  request ``output_len - 1`` steps (its first token comes from its prefill).
* KV: each decode step of a request reads its whole context once, every layer's cache entry per
  token: K and V of every KV head, or with multi-head latent attention (DeepSeek-V2/V3) the one
  latent of ``kv_lora_rank + qk_rope_head_dim`` (``kv_bytes_per_token``).
* Prefill: ``2 * active parameters`` FLOPs per prompt token (attention projections, router, the
  shared and top-k experts or the dense MLP), the causal attention's ``2 * heads * (qk_dim + v_dim)
  * p (p + 1) / 2`` per layer, and the LM head once per request, at the device's measured matmul
  peak.

Bytes go at the measured copy bandwidth (bytes read + written per second), as the W3 floor does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from transformers import PretrainedConfig


@dataclass(frozen=True)
class AttentionShape:
    """Per layer: the attention's projection parameters, the cache elements a token keeps and the
    FLOPs of one (query, key) pair."""

    params: int
    kv_elements: int
    flops_per_pair: int

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> AttentionShape:
        hidden, heads = config.hidden_size, config.num_attention_heads
        if getattr(config, "kv_lora_rank", None) is not None:
            # MLA: q (through q_lora_rank or not), kv_a to the latent and k_pe, kv_b, o.
            rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
            qk_dim, v_dim = config.qk_nope_head_dim + rope, config.v_head_dim
            q_lora = config.q_lora_rank
            q_params = hidden * heads * qk_dim if q_lora is None else q_lora * (hidden + heads * qk_dim)
            kv_params = hidden * (rank + rope) + rank * heads * (config.qk_nope_head_dim + v_dim)
            return cls(
                q_params + kv_params + heads * v_dim * hidden, rank + rope, 2 * heads * (qk_dim + v_dim)
            )
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(
            hidden * head_dim * (2 * heads + 2 * kv_heads), 2 * kv_heads * head_dim, 4 * heads * head_dim
        )


def kv_bytes_per_token(config: PretrainedConfig, element_size: int) -> int:
    """Bytes of KV cache one token takes over every layer (Llama-3.1-8B: 131,072 in bf16)."""
    return config.num_hidden_layers * AttentionShape.from_config(config).kv_elements * element_size


def _sparse_layers(config: PretrainedConfig) -> tuple[int, int]:
    """(number of sparse layers, routed experts' intermediate size)."""
    if config.model_type == "qwen3_moe":
        from pagedllm.models.qwen3_moe import is_sparse_layer

        num_sparse = sum(is_sparse_layer(config, i) for i in range(config.num_hidden_layers))
        return num_sparse, config.moe_intermediate_size
    if config.model_type in ("deepseek_v2", "deepseek_v3"):  # the first layers dense
        return config.num_hidden_layers - config.first_k_dense_replace, config.moe_intermediate_size
    return config.num_hidden_layers, config.intermediate_size  # Mixtral: every layer sparse


@dataclass(frozen=True)
class MoeShape:
    """The parameter counts of a mixture-of-experts decoder that the floor needs."""

    num_layers: int
    num_sparse_layers: int
    hidden_size: int
    attention: AttentionShape
    vocab_size: int
    num_experts: int
    top_k: int
    expert_params: int  # gate, up and down of one routed expert
    shared_expert_params: int  # of a sparse layer's shared experts together (DeepSeek's); 0: none
    dense_mlp_params: int  # gate, up and down of one dense layer's MLP

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> MoeShape:
        num_experts = (
            getattr(config, "num_experts", None)
            or getattr(config, "n_routed_experts", None)
            or config.num_local_experts
        )
        num_sparse, moe_intermediate = _sparse_layers(config)
        hidden = config.hidden_size
        expert_params = 3 * hidden * moe_intermediate
        return cls(
            num_layers=config.num_hidden_layers,
            num_sparse_layers=num_sparse,
            hidden_size=hidden,
            attention=AttentionShape.from_config(config),
            vocab_size=config.vocab_size,
            num_experts=num_experts,
            top_k=config.num_experts_per_tok,
            expert_params=expert_params,
            shared_expert_params=(getattr(config, "n_shared_experts", None) or 0) * expert_params,
            dense_mlp_params=3 * hidden * config.intermediate_size,
        )

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_sparse_layers

    def expected_experts(self, num_tokens: int) -> float:
        """Distinct experts a batch of ``num_tokens`` touches per layer, routing uniform."""
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** num_tokens)

    def decode_step_params(self, batch_size: int) -> float:
        """Parameters one decode step of ``batch_size`` sequences reads."""
        dense = (
            self.num_layers * self.attention.params
            + self.num_sparse_layers * (self.num_experts * self.hidden_size + self.shared_expert_params)
            + self.num_dense_layers * self.dense_mlp_params
            + self.vocab_size * self.hidden_size  # LM head
        )
        return dense + self.num_sparse_layers * self.expected_experts(batch_size) * self.expert_params

    @property
    def active_params_per_token(self) -> int:
        """Parameters a prompt token multiplies (no embedding, no LM head)."""
        return (
            self.num_layers * self.attention.params
            + self.num_sparse_layers
            * (
                self.num_experts * self.hidden_size
                + self.shared_expert_params
                + self.top_k * self.expert_params
            )
            + self.num_dense_layers * self.dense_mlp_params
        )

    def kv_bytes_per_token(self, element_size: int) -> int:
        return self.num_layers * self.attention.kv_elements * element_size


def offline_floor(
    prompt_lens: list[int],
    output_len: int,
    max_num_seqs: int,
    bandwidth: float,
    peak_flops: float,
    step_bytes: Callable[[int], dict[str, float]],
    kv_bytes_per_token: int,
    attention_flops_per_pair: int,
    prefill_params_per_token: float,
    lm_head_params: int,
    cached_prefix_len: int = 0,
) -> dict[str, Any]:
    """The floor of an offline run (seconds, and its parts), whatever the model: its requests
    decode in waves of ``max_num_seqs``, each of ``output_len - 1`` steps. ``step_bytes(batch)``:
    what one decode step of ``batch`` sequences reads and writes besides the KV, by name
    ("decode_weight", "state"); ``kv_bytes_per_token``: the cache a context token keeps;
    ``attention_flops_per_pair``: over every attention layer, per (query, key) pair of a causal
    prefill; ``prefill_params_per_token``: the parameters a prompt token multiplies (no embedding,
    no LM head), the LM head's once per request; ``cached_prefix_len``: the tokens every prompt
    starts with that prefix caching computes once, for the first request (the others' prefills
    skip their products; their keys are still attended to, and read at decode). bandwidth:
    bytes/s; peak_flops: FLOP/s."""
    num_requests, decode_steps = len(prompt_lens), output_len - 1
    totals: dict[str, float] = {}
    for wave in range(math.ceil(num_requests / max_num_seqs)):
        batch = min(max_num_seqs, num_requests - wave * max_num_seqs)
        for name, num_bytes in step_bytes(batch).items():
            totals[name] = totals.get(name, 0.0) + decode_steps * num_bytes
    # Context of a request's j-th decode step (j = 1 .. output_len - 1): p + j tokens.
    context_tokens = sum(decode_steps * p + decode_steps * (decode_steps + 1) // 2 for p in prompt_lens)
    totals["kv"] = context_tokens * kv_bytes_per_token
    attention_flops = sum(attention_flops_per_pair * p * (p + 1) // 2 for p in prompt_lens)
    computed_tokens = sum(prompt_lens)
    if cached_prefix_len:
        # Every request but the first finds the prefix cached: neither its tokens' products nor
        # their causal pairs among themselves are computed again.
        computed_tokens -= (num_requests - 1) * cached_prefix_len
        attention_flops -= (
            (num_requests - 1) * attention_flops_per_pair * cached_prefix_len * (cached_prefix_len + 1) // 2
        )
    prefill_flops = (
        2 * prefill_params_per_token * computed_tokens + attention_flops + 2 * num_requests * lm_head_params
    )
    parts = {f"{name}_s": num_bytes / bandwidth for name, num_bytes in totals.items()}
    parts["prefill_s"] = prefill_flops / peak_flops
    return {
        "floor_s": sum(parts.values()),
        **parts,
        **{f"{name}_tb": num_bytes / 1e12 for name, num_bytes in totals.items()},
        "prefill_tflop": prefill_flops / 1e12,
    }


def moe_floor(
    shape: MoeShape,
    prompt_lens: list[int],
    output_len: int,
    max_num_seqs: int,
    element_size: int,
    bandwidth: float,
    peak_flops: float,
    cached_prefix_len: int = 0,
) -> dict[str, Any]:
    """The floor of a run (seconds, and its parts). bandwidth: bytes/s; peak_flops: FLOP/s;
    cached_prefix_len: as ``offline_floor``'s."""
    floor = offline_floor(
        prompt_lens,
        output_len,
        max_num_seqs,
        bandwidth,
        peak_flops,
        lambda batch: {"decode_weight": shape.decode_step_params(batch) * element_size},
        shape.kv_bytes_per_token(element_size),
        shape.num_layers * shape.attention.flops_per_pair,
        shape.active_params_per_token,
        shape.vocab_size * shape.hidden_size,
        cached_prefix_len,
    )
    return {
        **floor,
        "experts_per_layer_at_max_batch": shape.expected_experts(min(max_num_seqs, len(prompt_lens))),
        "shape": asdict(shape),
    }
