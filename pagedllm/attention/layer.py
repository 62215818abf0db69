"""The attention layer models call: q/k/v (and positions, for a rotary embedding) in, attention
over the paged cache out.

Inside a torch.compile'd forward (the CPU's compiled decode step, worker/cpu_compile.py) the layer
calls its backend through one opaque op, ``pagedllm::attention``: the backend's host logic (cache
writes, block gathers, the choice of kernel) stays out of the traced graph, and the step's
metadata reaches the op through ``set_forward_metadata`` instead of being a graph input, so a new
context length is no new graph.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from pagedllm.attention.backends.abstract import AttentionBackend, KVCache, Rotary
from pagedllm.attention.metadata import AttentionMetadata

# The layers the op dispatches to, by ``Attention.layer_id`` (weak: models come and go).
_LAYERS: weakref.WeakValueDictionary[int, Attention] = weakref.WeakValueDictionary()
_layer_ids = itertools.count()
# The metadata of the step running a compiled forward.
_forward_metadata: AttentionMetadata | None = None


@contextmanager
def set_forward_metadata(attn_metadata: AttentionMetadata) -> Iterator[None]:
    """The metadata that ``pagedllm::attention`` reads while a compiled forward runs."""
    global _forward_metadata
    _forward_metadata = attn_metadata
    try:
        yield
    finally:
        _forward_metadata = None


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
    assert _forward_metadata is not None, "a compiled forward runs under set_forward_metadata"
    impl = _LAYERS[layer_id].impl
    # Query and key come rotated (see Attention.forward): no positions.
    return impl.forward(query, key, value, (key_cache, value_cache), _forward_metadata, sink_query=sink_query)


_lib.impl("attention", _attention_op, "CPU")


@torch.library.register_fake("pagedllm::attention")
def _attention_fake(query: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(query)


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache and attends over it.

    Holds no weights and no cache: the cache of its layer is passed in, so that the cache engine
    owns all KV memory and a model file never sees its layout.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        backend: type[AttentionBackend],
        *,
        sliding_window: int | None = None,
        alibi_slopes: torch.Tensor | None = None,
        logits_soft_cap: float | None = None,
        attention_sinks: int = 0,
        rotary: Rotary | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """The keyword arguments are this layer's attention variants (``AttentionBackend.__init__``)."""
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.impl = backend(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            sliding_window=sliding_window,
            alibi_slopes=alibi_slopes,
            logits_soft_cap=logits_soft_cap,
            attention_sinks=attention_sinks,
            rotary=rotary,
            sinks=sinks,
        )
        self.layer_id = next(_layer_ids)
        _LAYERS[self.layer_id] = self

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
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
            output = torch.ops.pagedllm.attention(query, key, value, *kv_cache, sink_query, self.layer_id)
        else:
            output = self.impl.forward(
                query, key, value, kv_cache, attn_metadata, sink_query=sink_query, positions=positions
            )
        return output.view(num_tokens, self.num_heads * self.head_size)
