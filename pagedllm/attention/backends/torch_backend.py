"""The reference attention backend: plain PyTorch over the paged cache.

This is the oracle every other backend is tested against, so it says what paged attention means
as directly as it can; it runs anywhere, and is the CPU path.

Cache layout (per layer): key_cache and value_cache are each
``[num_blocks, block_size, num_kv_heads, head_size]``, so ``cache.view(-1, num_kv_heads,
head_size)[slot]`` is one token's K (or V) and a sequence's context is its blocks, in block-table
order, flattened and cut at ``seq_len``.

Decodes (one query each) are computed together: their contexts are gathered into a padded
``[num_decodes, max_len, ...]`` tensor and masked past each ``seq_len``. Prefill chunks are
computed one sequence at a time with a causal mask aligned to the end of the context (the chunk's
queries are the last ``query_len`` positions). Both go through one written-out softmax
(``_attend``) that applies the layer's variants the way their papers define them: soft-capping,
ALiBi, the sliding window, attention sinks (StreamingLLM: the first ``attention_sinks`` keys stay
visible past the window, scored with a second query), learned sinks (gpt-oss: a per-head logit in
every softmax's denominator). Cost is linear in the number of sequences.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backends.abstract import AttentionBackend, KVCache
from pagedllm.attention.kv_quant import load_kv, store_kv
from pagedllm.attention.metadata import AttentionMetadata

# The scale of a cache in the model dtype (where it is unread).
_UNIT_SCALE = torch.ones(())


def write_to_paged_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] = (_UNIT_SCALE, _UNIT_SCALE),
) -> None:
    """Store each token's K/V at its slot; slots < 0 are padding and are skipped.

    key, value: [num_tokens, num_kv_heads, head_size]; caches: [num_blocks, block_size,
    num_kv_heads, head_size]; slot_mapping: [num_tokens]. kv_scales: (k_scale, v_scale), read
    by FP8 caches only (stored as saturate(x / scale), attention/kv_quant.py); a cache in the
    model dtype ignores them.
    """
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    num_kv_heads, head_size = key_cache.shape[2:]
    k_scale, v_scale = kv_scales
    store_kv(key_cache.view(-1, num_kv_heads, head_size), slots, key[valid], k_scale)
    store_kv(value_cache.view(-1, num_kv_heads, head_size), slots, value[valid], v_scale)


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: torch.Tensor = _UNIT_SCALE
) -> torch.Tensor:
    """One sequence's first ``seq_len`` cached tokens: [seq_len, num_kv_heads, head_size]
    (float32 ``x * scale`` from an FP8 cache)."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = load_kv(cache, block_table[:num_blocks].long(), scale)
    return blocks.flatten(0, 1)[:seq_len]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_fp8_kv_cache = True
    supports_context_parallel = True

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        return shape, shape

    @classmethod
    def check_supported(
        cls, head_size: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Plain PyTorch runs every shape, dtype and device."""

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
        """With ``lse`` ([num_tokens, num_heads] float32; ``forward_partial``), attention over
        this context-parallel rank's keys, each query's log-sum-exp written into it."""
        sink_query = self._check_sink_query(query, sink_query) if self.attention_sinks else None
        query, key = self.rotate(positions, query, key)
        key_cache, value_cache = kv_cache
        write_to_paged_cache(
            key, value, key_cache, value_cache, attn_metadata.slot_mapping, (self.k_scale, self.v_scale)
        )
        output = torch.empty_like(query)
        num_decodes = attn_metadata.num_decodes
        if num_decodes:
            output[:num_decodes] = self._decode(
                query[:num_decodes],
                None if sink_query is None else sink_query[:num_decodes],
                key_cache,
                value_cache,
                attn_metadata,
                None if lse is None else lse[:num_decodes],
            )
        query_start_loc = attn_metadata.query_start_loc_cpu.tolist()
        seq_lens = attn_metadata.seq_lens_cpu.tolist()
        for i in range(num_decodes, attn_metadata.num_seqs):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            output[start:end] = self._prefill(
                query[start:end],
                None if sink_query is None else sink_query[start:end],
                key_cache,
                value_cache,
                attn_metadata.block_tables[i],
                seq_lens[i],
                None if lse is None else lse[start:end],
            )
        return output

    def _local_len(self, seq_len: torch.Tensor | int) -> torch.Tensor | int:
        """The keys of a context of ``seq_len`` tokens this rank's cache holds (all of them
        without context parallelism)."""
        size, rank = self.cp_world_size, self.cp_rank
        if size == 1:
            return seq_len
        local = (seq_len - rank + size - 1) // size
        return local.clamp_min(0) if isinstance(local, torch.Tensor) else max(local, 0)

    def _key_positions(self, num_keys: int, device: torch.device) -> torch.Tensor:
        """The context positions of this rank's first ``num_keys`` cached keys."""
        return torch.arange(num_keys, device=device) * self.cp_world_size + self.cp_rank

    def _decode(
        self,
        query: torch.Tensor,
        sink_query: torch.Tensor | None,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
        lse: torch.Tensor | None,
    ) -> torch.Tensor:
        """query (and sink_query, None without sinks): [num_decodes, num_heads, head_size], one
        token per sequence."""
        num_decodes = query.shape[0]
        block_size = key_cache.shape[1]
        seq_lens = md.seq_lens[:num_decodes].long()
        max_len = int(self._local_len(md.seq_lens_cpu[:num_decodes].max()))
        num_blocks = max((max_len + block_size - 1) // block_size, 1)
        block_tables = md.block_tables[:num_decodes, :num_blocks].long()
        # [num_decodes, num_blocks * block_size, num_kv_heads, head_size]
        keys = load_kv(key_cache, block_tables, self.k_scale).flatten(1, 2)
        values = load_kv(value_cache, block_tables, self.v_scale).flatten(1, 2)
        k_pos = self._key_positions(keys.shape[1], query.device)
        q_pos = (seq_lens - 1)[:, None]  # [num_decodes, 1]: each query is its context's last token
        valid = torch.arange(keys.shape[1], device=query.device)[None, :] < self._local_len(seq_lens)[:, None]
        sinks = None if sink_query is None else sink_query[:, None]
        out = self._attend(query[:, None], sinks, keys, values, q_pos, k_pos, valid, lse)
        return out[:, 0]

    def _prefill(
        self,
        query: torch.Tensor,
        sink_query: torch.Tensor | None,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
        lse: torch.Tensor | None,
    ) -> torch.Tensor:
        """query: [query_len, num_heads, head_size], the last query_len positions of the context."""
        query_len = query.shape[0]
        num_keys = self._local_len(seq_len)
        keys = gather_context(key_cache, block_table, num_keys, self.k_scale)[None]
        values = gather_context(value_cache, block_table, num_keys, self.v_scale)[None]
        # Query i sits at position seq_len - query_len + i.
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)[None]
        k_pos = self._key_positions(num_keys, query.device)
        valid = torch.ones(1, num_keys, dtype=torch.bool, device=query.device)
        sinks = None if sink_query is None else sink_query[None]
        return self._attend(query[None], sinks, keys, values, q_pos, k_pos, valid, lse)[0]

    def _attend(
        self,
        query: torch.Tensor,
        sink_query: torch.Tensor | None,
        keys: torch.Tensor,
        values: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        valid: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Softmax attention in float32 with every variant, written out.

        query: [batch, num_queries, num_heads, head_size]; keys, values: [batch, num_keys,
        num_kv_heads, head_size]; q_pos: [batch, num_queries] and k_pos: [num_keys] context
        positions; valid: [batch, num_keys], the keys that exist; sink_query: like query, or None
        without sinks. Returns the shape of query. With ``lse`` ([batch, num_queries, num_heads]
        float32, written), the attention is a context-parallel rank's partial: each row's
        log-sum-exp goes there, and a row with no visible key gets 0 and -inf.

        Visible: the keys that exist, ``k <= q``, and with a window ``k > q - sliding_window`` or
        (attention sinks) ``k < attention_sinks``. A visible sink outside the window is scored with
        sink_query, every other key with query; one softmax over them all.
        """
        group = self.num_queries_per_kv
        distance = k_pos[None, None, :] - q_pos[:, :, None]  # [b, q, k]: key minus query position
        in_window = distance <= 0
        if self.sliding_window is not None:
            in_window &= distance > -self.sliding_window
        # The sinks the window has passed (none without sinks; attention_sinks implies a window).
        sink = torch.zeros_like(in_window)
        if self.attention_sinks:
            sink = (distance <= -self.sliding_window) & (k_pos < self.attention_sinks)
        visible = valid[:, None, :] & (in_window | sink)
        # Slots no query sees -- past seq_len, or between the sinks and the window, whose blocks
        # the engine may have freed -- may hold anything, NaN included: select, never multiply,
        # them away (a masked probability is 0, and 0 * NaN is NaN). Zeroed keys keep NaN out of
        # the scores as well, so the selections below never meet one.
        seen = visible.any(dim=1)[:, :, None, None]  # [b, k, 1, 1]: visible to some query
        keys = torch.where(seen, keys.float(), 0.0)
        values = torch.where(seen, values.float(), 0.0)

        def scores_of(q: torch.Tensor) -> torch.Tensor:
            q = q.float().unflatten(2, (self.num_kv_heads, group))  # [b, q, kvh, g, d]
            scores = torch.einsum("bqhgd,bkhd->bhgqk", q, keys) * self.scale
            if self.logits_soft_cap is not None:
                scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
            return scores

        scores = scores_of(query)
        if sink_query is not None:
            scores = torch.where(sink[:, None, None], scores_of(sink_query), scores)
        if self.alibi_slopes is not None:
            slopes = self.alibi_slopes.view(self.num_kv_heads, group)
            scores = scores + slopes[None, :, :, None, None] * distance[:, None, None].float()
        scores = torch.where(visible[:, None, None], scores, float("-inf"))
        if lse is not None:
            # [b, kvh, g, q]; a row with no visible key is all -inf: its probabilities are 0.
            row_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - torch.where(row_lse.isinf(), 0.0, row_lse)[..., None])
            lse.copy_(row_lse.permute(0, 3, 1, 2).flatten(2).view(lse.shape))
        elif self.sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            # The learned sink: one more logit per head in the softmax, its probability dropped.
            sink = self.sinks.float().view(self.num_kv_heads, group)[None, :, :, None, None]
            sink = sink.expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        out = torch.einsum("bhgqk,bkhd->bqhgd", probs, values)
        return out.flatten(2, 3).to(query.dtype)
