"""The GPU attention step, composed of a backend's pieces.

Every GPU backend runs the same step: write this step's K/V into the paged cache, then attend
with the decode kernel for the decodes (sequences ``[0, num_decodes)``) and with the prefill
kernel for the prefill chunks after them. A backend is that step with four pieces of its own:

* a cache layout: ``get_kv_cache_shape``, and ``check_supported`` for what its kernels are built for;
* a cache write, which rotates query and key on the way where its kernel can (one kernel, not
  two) and otherwise rotates them first (``AttentionBackend.rotate``);
* a decode and a prefill.

Pieces are functions of the layer (``PagedAttentionBackend``, for its variants) and the step's
tensors; a backend names its own and may take another backend's (the CUDA backend prefills with
the Triton kernel, which reads both layouts). Grids come from host ints in the metadata
(``max_seq_len``, ``max_query_len``): forward never syncs with the device, and with
``max_seq_len`` pinned to ``max_model_len`` a decode step is CUDA-graph capturable.

Context parallelism (``cp_world_size`` P > 1) runs the same step through ``forward_partial``: the
cache holds this rank's stripe of every context (global position ``t`` at local index ``t // P`` on
rank ``t % P``), the metadata stays global, and the pieces, given an ``lse`` to write, attend each
query to this rank's keys only and return the log-sum-exp of its scores, for the attention layer to
merge across ranks. A backend whose pieces take ``lse`` says so with ``supports_context_parallel``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from pagedllm.attention.backends.abstract import AttentionBackend, KVCache
from pagedllm.attention.metadata import AttentionMetadata

# write_cache(layer, query, key, value, kv_cache, slot_mapping, positions) -> the query the
# kernels read (rotated, where the layer has a rotary embedding).
CacheWrite = Callable[..., torch.Tensor]
# decode(layer, query, sink_query, key_cache, value_cache, block_tables, seq_lens,
# (min_seq_len, max_seq_len), out[, lse=][, query_groups=(decode_query_lens, max)]): the decodes'
# rows of out (and of lse, when given); query_groups only for a backend that
# ``groups_decode_queries``.
Decode = Callable[..., None]
# prefill(layer, query, sink_query, kv_cache, block_tables, seq_lens, query_start_loc,
# (first_seq, num_seqs, max_query_len), out[, lse=]): the rows of sequences [first, first + num)
# of out (and of lse, when given).
Prefill = Callable[..., None]


class PagedAttentionBackend(AttentionBackend):
    """The step; subclasses name the pieces (``write_cache``, ``decode``, ``prefill``) and the
    layout (``get_kv_cache_shape``, ``check_supported``)."""

    supports_cuda_graphs = True
    # Whether the decode piece attends a request's verified tokens together (the metadata's
    # decode_query_lens): each program then reads the request's K/V once for all its tokens.
    groups_decode_queries: ClassVar[bool] = False
    # Whether the decode piece takes ``append=(key, value, slot_mapping, rotary)``: in a step of
    # decodes only it writes (and rotates) the new tokens' K/V itself, one kernel instead of two.
    appends_in_decode: ClassVar[bool] = False
    write_cache: ClassVar[CacheWrite]
    decode: ClassVar[Decode]
    prefill: ClassVar[Prefill]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # This layer's variants as the kernels take them, built once rather than every step.
        self.kernel_variants = {
            "sliding_window": self.sliding_window,
            "alibi_slopes": self.alibi_slopes,
            "logits_soft_cap": self.logits_soft_cap,
            "attention_sinks": self.attention_sinks,
            "sinks": self.sinks,
        }
        # Query groups for the layers whose tokens differ only in their last keys: not behind a
        # window (each token's window starts elsewhere) or a striped cache.
        self.groups_queries = (
            self.groups_decode_queries and self.sliding_window is None and self.cp_world_size == 1
        )
        # The decode's own cache write: one query per sequence at its last key, read by the one
        # program that writes it (not a striped cache, not StreamingLLM's sink queries).
        self.appends = self.appends_in_decode and self.cp_world_size == 1 and not self.attention_sinks

    def rotary_rows(self, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The ``(cos_sin, index)`` rows of ``positions`` for a kernel that rotates as it writes
        the cache; None where the layer has no rotary embedding of its own to apply."""
        return None if self.rotary is None or positions is None else self.rotary.cos_sin_rows(positions)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        sink_query: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """AttentionBackend.forward; with ``lse`` (forward_partial's), attention over this
        context-parallel rank's keys, each row's log-sum-exp written to lse."""
        # Passed to the pieces only when given: a backend without context parallelism has pieces
        # that do not take it.
        partial = {} if lse is None else {"lse": lse}
        sink_query = self._check_sink_query(query, sink_query) if self.attention_sinks else None
        key_cache, value_cache = kv_cache
        md = attn_metadata
        num_decodes = md.num_decodes
        options = {name: rows[:num_decodes] for name, rows in partial.items()}
        # Decodes only, one token each (a verification's tokens read each other's keys): the
        # decode writes them. Else the cache write runs first, for every token.
        if self.appends and md.num_prefills == 0 and md.decode_query_lens is None:
            assert key.shape[0] == num_decodes, f"{key.shape[0]} tokens for {num_decodes} decodes"
            options["append"] = (key, value, md.slot_mapping, self.rotary_rows(positions))
        else:
            query = self.write_cache(query, key, value, kv_cache, md.slot_mapping, positions)
        # Contiguous whatever the query's strides (it is a view of the fused QKV): the kernels
        # write rows of num_heads * head_size.
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if num_decodes:
            if self.groups_queries and md.decode_query_lens is not None:
                options["query_groups"] = (md.decode_query_lens[:num_decodes], md.max_decode_query_len)
            self.decode(
                query[:num_decodes],
                None if sink_query is None else sink_query[:num_decodes],
                key_cache,
                value_cache,
                md.block_tables[:num_decodes],
                md.seq_lens[:num_decodes],
                (md.min_decode_seq_len, md.max_seq_len),
                output[:num_decodes],
                **options,
            )
        if md.num_prefills:
            self.prefill(
                query,
                sink_query,
                kv_cache,
                md.block_tables,
                md.seq_lens,
                md.query_start_loc,
                (num_decodes, md.num_prefills, md.max_query_len),
                output,
                **partial,
            )
        return output


def check_kernels_support(
    backend: str,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    supported: tuple[tuple[int, ...], tuple[int, ...], tuple[torch.dtype, ...]],
) -> None:
    """ValueError naming the first of head_size, block_size and dtype outside what ``backend``'s
    kernels are built for (``supported``: head sizes, block sizes, dtypes)."""
    head_sizes, block_sizes, dtypes = supported
    if head_size not in head_sizes:
        raise ValueError(f"{backend} attention: head_size {head_size} not in {head_sizes}")
    if block_size not in block_sizes:
        raise ValueError(f"{backend} attention: block_size {block_size} not in {block_sizes}")
    if dtype not in dtypes:
        raise ValueError(f"{backend} attention: dtype {dtype} not in {dtypes}")
