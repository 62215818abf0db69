"""The physical floor of an offline run of a hybrid model (W6: Gated DeltaNet or Mamba-2 layers
beside a few attention layers, benchmarks/README.md), as ``moe_floor.py``'s for a mixture of
experts (``offline_floor``), counted on the model built on the meta device rather than from the
config's fields:

* Decode weights: each step reads every parameter but the embedding, the routed experts only as
  far as the batch touches them (uniform routing: a batch of ``B`` tokens touches a fraction
  ``1 - (1 - k / E) ** B`` of each layer's experts).
* KV: each decode step reads its sequence's context in the attention layers only.
* State: each decode step reads and writes each running request's recurrent state once, whatever
  its context (the conv window and the state of every linear layer).
* Prefill: ``2 x`` the parameters a prompt token multiplies (no embedding, no LM head; ``k`` of
  the ``E`` routed experts), the attention layers' causal ``4 heads head_dim p (p + 1) / 2``, and
  the LM head once per request, at the device's measured matmul peak. The linear layers' chunked
  recurrence is left out (a few percent of the projections' FLOPs at W6's shape).

Bytes go at the measured copy bandwidth, as the other floors.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.entrypoints.bench.moe_floor import offline_floor
from pagedllm.models import get_model_class

# Model types whose floor this module knows (the model class names its state and attention layers).
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "nemotron_h")


@dataclass(frozen=True)
class HybridShape:
    """What the floor needs of a hybrid model, in parameters and elements."""

    dense_params: int  # every parameter but the embedding and the routed experts (LM head included)
    lm_head_params: int
    routed_expert_params: int  # of every sparse layer together; 0 without experts
    top_k: int
    num_experts: int
    num_attention_layers: int
    attention_flops_per_pair: int  # per attention layer and (query, key) pair
    kv_elements_per_token: int  # over the attention layers
    state_elements: int  # per request, over the linear layers
    vocab_size: int
    hidden_size: int

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> HybridShape:
        model_class = get_model_class(config.architectures, config.model_type)
        with torch.device("meta"):
            model = model_class(config, TorchAttentionBackend)
        embedding = routed = lm_head = total = 0
        for name, param in model.named_parameters():
            total += param.numel()
            if "embed_tokens" in name:
                embedding += param.numel()
            elif ".experts." in name:
                routed += param.numel()
            elif name.startswith("lm_head"):
                lm_head += param.numel()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        num_attention = model_class.num_attention_layers(config)
        states = model_class.state_shapes(config, 1)
        return cls(
            dense_params=total - embedding - routed,
            lm_head_params=lm_head,
            routed_expert_params=routed,
            top_k=getattr(config, "num_experts_per_tok", 0) or 0,
            num_experts=getattr(config, "num_experts", 0) or 0,
            num_attention_layers=num_attention,
            attention_flops_per_pair=4 * heads * head_dim,
            kv_elements_per_token=num_attention * 2 * config.num_key_value_heads * head_dim,
            state_elements=sum(math.prod(s.conv_shape) + math.prod(s.ssm_shape) for s in states),
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
        )

    def touched_expert_fraction(self, num_tokens: int) -> float:
        """The fraction of each layer's routed experts a batch of ``num_tokens`` touches."""
        if not self.num_experts:
            return 0.0
        return 1.0 - (1.0 - self.top_k / self.num_experts) ** num_tokens

    @property
    def active_params_per_token(self) -> float:
        """Parameters a prompt token multiplies (no embedding, no LM head)."""
        routed = self.routed_expert_params * self.top_k / self.num_experts if self.num_experts else 0
        return self.dense_params - self.lm_head_params + routed


def hybrid_floor(
    shape: HybridShape,
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

    def step_bytes(batch: int) -> dict[str, float]:
        params = shape.dense_params + shape.routed_expert_params * shape.touched_expert_fraction(batch)
        return {
            "decode_weight": params * element_size,
            "state": batch * 2 * shape.state_elements * element_size,  # read and written
        }

    floor = offline_floor(
        prompt_lens,
        output_len,
        max_num_seqs,
        bandwidth,
        peak_flops,
        step_bytes,
        shape.kv_elements_per_token * element_size,
        shape.num_attention_layers * shape.attention_flops_per_pair,
        shape.active_params_per_token,
        shape.vocab_size * shape.hidden_size,
        cached_prefix_len,
    )
    return {**floor, "shape": asdict(shape)}
