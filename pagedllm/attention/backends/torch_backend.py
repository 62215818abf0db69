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
queries are the last ``query_len`` positions). Cost is linear in the number of sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.backends.abstract import AttentionBackend, KVCache
from pagedllm.attention.metadata import AttentionMetadata


def write_to_paged_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V at its slot; slots < 0 are padding and are skipped.

    key, value: [num_tokens, num_kv_heads, head_size]; caches: [num_blocks, block_size,
    num_kv_heads, head_size]; slot_mapping: [num_tokens].
    """
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    num_kv_heads, head_size = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_size)[slots] = key[valid].to(key_cache.dtype)
    value_cache.view(-1, num_kv_heads, head_size)[slots] = value[valid].to(value_cache.dtype)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first ``seq_len`` cached tokens: [seq_len, num_kv_heads, head_size]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.flatten(0, 1)[:seq_len]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

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
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        write_to_paged_cache(key, value, key_cache, value_cache, attn_metadata.slot_mapping)
        output = torch.empty_like(query)
        num_decodes = attn_metadata.num_decodes
        if num_decodes:
            output[:num_decodes] = self._decode(query[:num_decodes], key_cache, value_cache, attn_metadata)
        query_start_loc = attn_metadata.query_start_loc_cpu.tolist()
        seq_lens = attn_metadata.seq_lens_cpu.tolist()
        for i in range(num_decodes, attn_metadata.num_seqs):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            output[start:end] = self._prefill(
                query[start:end], key_cache, value_cache, attn_metadata.block_tables[i], seq_lens[i]
            )
        return output

    def _decode(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """query: [num_decodes, num_heads, head_size], one token per sequence."""
        num_decodes = query.shape[0]
        block_size = key_cache.shape[1]
        seq_lens = md.seq_lens[:num_decodes].long()
        max_len = int(md.seq_lens_cpu[:num_decodes].max())
        num_blocks = (max_len + block_size - 1) // block_size
        block_tables = md.block_tables[:num_decodes, :num_blocks].long()
        # [num_decodes, num_blocks * block_size, num_kv_heads, head_size]
        keys = key_cache[block_tables].flatten(1, 2).float()
        values = value_cache[block_tables].flatten(1, 2).float()
        positions = torch.arange(keys.shape[1], device=query.device)
        valid = positions[None, :] < seq_lens[:, None]  # [num_decodes, max_len]
        # Slots past seq_len may hold anything, NaN included: select, never multiply, them away.
        values = torch.where(valid[:, :, None, None], values, 0.0)
        q = query.float().view(num_decodes, self.num_kv_heads, self.num_queries_per_kv, self.head_size)
        scores = torch.einsum("bhgd,blhd->bhgl", q, keys) * self.scale
        scores = torch.where(valid[:, None, None, :], scores, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgl,blhd->bhgd", probs, values)
        return out.reshape(num_decodes, self.num_heads, self.head_size).to(query.dtype)

    def _prefill(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
    ) -> torch.Tensor:
        """query: [query_len, num_heads, head_size], the last query_len positions of the context."""
        query_len = query.shape[0]
        keys = gather_context(key_cache, block_table, seq_len)
        values = gather_context(value_cache, block_table, seq_len)
        # Query i sits at position seq_len - query_len + i and sees keys up to that position.
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).float(),
            keys.transpose(0, 1).float(),
            values.transpose(0, 1).float(),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.num_queries_per_kv > 1,
        )
        return out.transpose(0, 1).to(query.dtype)
