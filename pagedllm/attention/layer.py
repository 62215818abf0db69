"""The attention layer models call: q/k/v (and positions, for a rotary embedding) in, attention
over the paged cache out.

Inside a torch.compile'd forward (the CPU's compiled decode step, worker/cpu_compile.py) the layer
calls its backend through one opaque op, ``pagedllm::attention``: the backend's host logic (cache
writes, block gathers, the choice of kernel) stays out of the traced graph, and the op reads the
step's metadata from the forward context (attention/forward_context.py) when it runs instead of
taking it as a graph input, so a new context length is no new graph.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import nn

from pagedllm.attention.backends.abstract import AttentionBackend, KVCache
from pagedllm.attention.context_parallel import merge_across_ranks
from pagedllm.attention.forward_context import get_forward_context
from pagedllm.distributed import get_context_parallel_rank, get_context_parallel_world_size

# The layers the op dispatches to, by ``Attention.layer_id`` (weak: models come and go).
_LAYERS: weakref.WeakValueDictionary[int, Attention] = weakref.WeakValueDictionary()
_layer_ids = itertools.count()


_lib = torch.library.Library("pagedllm", "FRAGMENT")
# Registered through the low-level API, not torch.library.custom_op: its Python wrapper cost
# ~60 us a call, twice the attention itself for one decode.
_lib.define(
    "attention(Tensor query, Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor? sink_query, int layer_id) -> Tensor"
)


def _attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    sink_query: torch.Tensor | None,
    layer_id: int,
) -> torch.Tensor:
    layer = _LAYERS[layer_id]
    attn_metadata = get_forward_context().attn_metadata
    # Query and key come rotated (see Attention.forward): no positions.
    return layer.attend(query, key, value, (key_cache, value_cache), attn_metadata, sink_query=sink_query)


_lib.impl("attention", _attention_op, "CPU")


@torch.library.register_fake("pagedllm::attention")
def _attention_fake(query: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(query)


class AttentionLayerBase(nn.Module):
    """A layer that keeps a paged KV cache: ``Attention``, and attention a model computes itself
    (multi-head latent attention, models/deepseek_v2.py).

    The cache engine owns the memory; ``bind_kv_caches`` hands each such layer its own cache
    (one ``(key_cache, value_cache)``, in the backend's layout), so a model file never passes
    caches around nor sees their layout.
    """

    kv_cache: KVCache | None = None


def bind_kv_caches(model: nn.Module, kv_caches: list[KVCache] | None) -> None:
    """Give each KV-caching layer of ``model``, in module order (the layers' order), its cache:
    ``kv_caches[i]`` to the i-th; None takes them back (the memory profile's one block, freed
    before the real cache is allocated and bound)."""
    layers = [m for m in model.modules() if isinstance(m, AttentionLayerBase)]
    if kv_caches is None:
        kv_caches = [None] * len(layers)
    if len(layers) != len(kv_caches):
        raise ValueError(f"{len(kv_caches)} KV caches for {len(layers)} attention layers")
    for layer, kv_cache in zip(layers, kv_caches):
        layer.kv_cache = kv_cache


class Attention(AttentionLayerBase):
    """Writes this step's K/V into its layer's paged cache (``kv_cache``, bound by
    ``bind_kv_caches``) and attends over it, with the step's metadata from the forward context.

    Holds no weights.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        backend: type[AttentionBackend],
        **variants: Any,
    ) -> None:
        """``variants``: this layer's attention variants, the keyword arguments of
        ``AttentionBackend.__init__`` (sliding_window, alibi_slopes, logits_soft_cap,
        attention_sinks, rotary, sinks), which checks them."""
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        cp = get_context_parallel_world_size()
        if cp > 1:
            _check_context_parallel(backend, cp, variants)
            variants.update(cp_rank=get_context_parallel_rank(), cp_world_size=cp)
        self.impl = backend(num_heads, head_size, scale, num_kv_heads, **variants)
        # Chosen once: over the whole cache, or over this rank's stripe and merged across ranks.
        self.attend = self._attend_striped if cp > 1 else self.impl.forward
        self.layer_id = next(_layer_ids)
        _LAYERS[self.layer_id] = self

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sink_query: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query: [num_tokens, num_heads * head_size]; key, value: [num_tokens, num_kv_heads *
        head_size]; sink_query (with attention_sinks): like query, the query that scores the sinks
        outside its window; positions (with a rotary embedding): [num_tokens], query and key not
        yet rotated, the backend rotates them (or fuses the rotation). Returns [num_tokens,
        num_heads * head_size]."""
        num_tokens = query.shape[0]
        if sink_query is not None:
            sink_query = sink_query.view(num_tokens, self.num_heads, self.head_size)
        query = query.view(num_tokens, self.num_heads, self.head_size)
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        if torch.compiler.is_compiling():
            # Rotated in the graph, where inductor fuses the rotation, not in the op, whose schema
            # says it leaves query and key as they are (the CPU kernel rotates in place).
            query, key = self.impl.rotate(positions, query, key)
            key_cache, value_cache = self.kv_cache
            output = torch.ops.pagedllm.attention(
                query, key, value, key_cache, value_cache, sink_query, self.layer_id
            )
        else:
            attn_metadata = get_forward_context().attn_metadata
            output = self.attend(
                query, key, value, self.kv_cache, attn_metadata, sink_query=sink_query, positions=positions
            )
        return output.view(num_tokens, self.num_heads * self.head_size)

    def _attend_striped(self, *inputs: Any, **options: Any) -> torch.Tensor:
        """``impl.forward``'s arguments: this rank's partial attention, merged across ranks."""
        return merge_across_ranks(*self.impl.forward_partial(*inputs, **options))


def _check_context_parallel(backend: type[AttentionBackend], cp: int, variants: dict[str, Any]) -> None:
    """Refuse, at construction, a layer context parallelism cannot split."""
    if not backend.supports_context_parallel:
        raise ValueError(
            f"context_parallel_size={cp} needs an attention backend that reads a striped cache "
            f"('torch' or 'triton'), got {backend.name!r}"
        )
    if variants.get("sinks") is not None or variants.get("attention_sinks"):
        raise ValueError(
            f"context_parallel_size={cp} does not support attention sinks (learned or kept): the sink "
            "term belongs to no rank's stripe"
        )
