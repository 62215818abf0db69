"""The attention layer models call: q/k/v in, attention over the paged cache out."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backends.abstract import AttentionBackend, KVCache
from pagedllm.attention.metadata import AttentionMetadata


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
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        sink_query: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """query: [num_tokens, num_heads * head_size]; key, value: [num_tokens, num_kv_heads *
        head_size]; sink_query (with attention_sinks): like query, the query that scores the sinks
        outside its window; rotary (only where ``fuses_rotary``): ``(cos_sin, index)``, query and
        key not yet rotated. Returns [num_tokens, num_heads * head_size]."""
        num_tokens = query.shape[0]
        if sink_query is not None:
            sink_query = sink_query.view(num_tokens, self.num_heads, self.head_size)
        output = self.impl.forward(
            query.view(num_tokens, self.num_heads, self.head_size),
            key.view(num_tokens, self.num_kv_heads, self.head_size),
            value.view(num_tokens, self.num_kv_heads, self.head_size),
            kv_cache,
            attn_metadata,
            sink_query=sink_query,
            **({} if rotary is None else {"rotary": rotary}),
        )
        return output.view(num_tokens, self.num_heads * self.head_size)

    @property
    def fuses_rotary(self) -> bool:
        """Whether forward takes ``rotary`` (the backend rotates as it writes the cache)."""
        return self.impl.fuses_rotary
