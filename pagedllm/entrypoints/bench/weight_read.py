"""The weight bytes one decode step of a single token reads: the W3 floor's numerator.

Counted at the formats the layers keep after loading, not the checkpoint's or the model dtype's:

* linear layers: every tensor they hold (an FP8 weight's byte per value plus its scales, a 4-bit
  weight's half byte plus its groups' scales and zeros, a dense weight at its dtype, biases);
* the input embedding: one row (a token reads its own row, not the table);
* the LM head: the whole table, once (a tied head is the embedding's table: the table plus the
  looked-up row);
* fused mixture-of-experts layers: ``top_k / num_experts`` of their experts (one token touches
  ``top_k`` of them);
* everything else (norms, attention sinks, routers' own parameters): their parameters. Buffers
  outside the layers above are caches (rotary cos/sin), not weights a step streams.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.layers.fused_moe.layer import FusedMoE
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding


def _own_tensors(module: nn.Module, with_buffers: bool) -> list[torch.Tensor]:
    tensors = [p for p in module.parameters(recurse=False)]
    if with_buffers:
        tensors += [b for b in module.buffers(recurse=False)]
    return tensors


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a one-token decode step of ``model`` (this rank's shard) reads."""
    head = getattr(model, "lm_head", None)
    # Tensors counted whole, by identity (a tied head's table is the embedding's parameter; the
    # CPU's oneDNN-packed weights have no data pointer to compare).
    seen: set[int] = set()

    def whole(tensors: list[torch.Tensor]) -> int:
        fresh = [t for t in tensors if id(t) not in seen]
        seen.update(id(t) for t in fresh)
        return sum(_nbytes(t) for t in fresh)

    total = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            tensors = _own_tensors(module, with_buffers=True)
            if module is head or isinstance(module, ParallelLMHead):
                total += whole(tensors)
            if not isinstance(module, ParallelLMHead):  # looked up: one row per token
                total += sum(_nbytes(t) for t in tensors) // (module.vocab_end - module.vocab_start)
        elif isinstance(module, LinearBase):
            total += whole(_own_tensors(module, with_buffers=True))
        elif isinstance(module, FusedMoE):
            expert_bytes = whole(_own_tensors(module, with_buffers=True))
            total += expert_bytes * min(module.top_k, module.num_experts) // module.num_experts
        else:
            total += whole(_own_tensors(module, with_buffers=False))
    return total


def worker_decode_weight_bytes(worker: Any) -> int:
    """Run on a rank (``collective_rpc``): ``decode_weight_bytes`` of its model."""
    return decode_weight_bytes(worker.model_runner.model)
