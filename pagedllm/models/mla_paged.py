"""Multi-head latent attention's GPU step (the Triton attention backend): ``MLAAttention``'s
``_step_per_sequence`` computed with every decode of the step in one launch of the MLA decode
kernel (kernels/triton/mla_decode.py) and the prefill chunks expanded together, in padded batches.
Its own module because it imports triton, an optional dependency: ``MLAAttention`` imports it when
it is built for the Triton backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.triton.mla_decode import check_mla_dims, mla_decode
from pagedllm.kernels.triton.reshape_and_cache import reshape_and_cache

__all__ = ["check_mla_dims", "step_paged"]

# A padded prefill batch holds at most this many (context token, head) pairs of expanded keys and
# values (V2-Lite's 16 heads: 65,536 context tokens, 0.67 GB in bf16); a longer context is a
# batch of its own, as the per-sequence path would expand it.
_PREFILL_BATCH_ELEMENTS = 2**20


def step_paged(
    layer: nn.Module, q: torch.Tensor, entry: torch.Tensor, cache: torch.Tensor, md: AttentionMetadata
) -> torch.Tensor:
    """layer: the ``MLAAttention`` (its dims, projections, W_UK and W_UV; not imported here, which
    it imports). q: [num_tokens, num_heads, qk_head_dim] (rotated); entry:
    [num_tokens, 1, r + rope], each token's latent; cache: the layer's, the Triton layout of one KV
    head [num_blocks, 1, block_size, r + rope] (the same memory as the torch layout's [num_blocks,
    block_size, 1, r + rope]) -> [num_tokens, num_heads, v_head_dim].

    Decodes take the absorbed form: W_UK^T q_nope as one batched matmul over the heads, the
    kernel, then W_UV the same way. Prefill chunks take the expanded form (cheaper when many
    queries share a context), batched: ``_prefill_batch``. Nothing here syncs with the device
    (grids and batch sizes come from the metadata's host copies, indices from its device tensors):
    a decode-only step is CUDA-graph capturable.
    """
    num_blocks, width = cache.shape[0], cache.shape[-1]
    # The latent is both key and value: the write's two copies land on the same slot.
    latents = cache.view(num_blocks, 1, -1, width)
    reshape_and_cache(entry, entry, latents, latents, md.slot_mapping)
    output = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
    num_decodes = md.num_decodes
    if num_decodes:
        nope = layer.qk_nope_head_dim
        # [num_heads, num_decodes, *]: the heads are the batch of both matmuls.
        q_latent = torch.bmm(q[:num_decodes, :, :nope].transpose(0, 1), layer.w_uk)
        out_latent = torch.empty_like(q_latent)
        mla_decode(
            q_latent.transpose(0, 1),
            q[:num_decodes, :, nope:],
            cache.view(num_blocks, -1, width),
            md.block_tables[:num_decodes],
            md.seq_lens[:num_decodes],
            layer.scale,
            md.max_seq_len,
            out_latent.transpose(0, 1),
            min_seq_len=md.min_decode_seq_len,
        )
        output[:num_decodes] = torch.bmm(out_latent, layer.w_uv.transpose(1, 2)).transpose(0, 1)
    if md.num_prefills:
        starts, seq_lens = md.query_start_loc_cpu.tolist(), md.seq_lens_cpu.tolist()
        for group in _prefill_groups(seq_lens, num_decodes, layer.num_heads):
            max_q = max(starts[i + 1] - starts[i] for i in group)
            bounds = (max_q, max(seq_lens[i] for i in group))
            _prefill_batch(layer, q, cache.view(num_blocks, -1, width), md, group, bounds, output)
    return output


def _prefill_groups(seq_lens: list[int], first: int, num_heads: int) -> list[range]:
    """Sequences [first, len(seq_lens)) cut into consecutive groups whose padded contexts hold at
    most _PREFILL_BATCH_ELEMENTS (token, head) pairs (a longer context alone)."""
    groups, start, longest = [], first, 0
    for i in range(first, len(seq_lens)):
        longest = max(longest, seq_lens[i])
        if i > start and (i - start + 1) * longest * num_heads > _PREFILL_BATCH_ELEMENTS:
            groups.append(range(start, i))
            start, longest = i, seq_lens[i]
    return [*groups, range(start, len(seq_lens))] if start < len(seq_lens) else groups


def _prefill_batch(
    layer: nn.Module,
    q: torch.Tensor,
    latents: torch.Tensor,
    md: AttentionMetadata,
    group: range,
    bounds: tuple[int, int],
    output: torch.Tensor,
) -> None:
    """The expanded form for the prefill chunks of sequences ``group`` at once; writes their rows
    of ``output``. latents: [num_blocks, block_size, r + rope]; bounds: the group's longest query
    and context (host ints, from the metadata's host copies).

    Their contexts are gathered into one zero-padded [n, max_len, r + rope] batch, expanded by
    ``kv_b_proj`` in one matmul, and attended by SDPA with a mask per sequence (its queries are the
    last query_len positions of its context: causal, aligned to the end). Padding costs attention
    FLOPs only, a few percent of the expansion's and projections' at W7's prompts. Indices come
    from the metadata's device tensors: no host-to-device copy."""
    (max_q, max_len), block_size, device = bounds, latents.shape[1], q.device
    query_start = md.query_start_loc[group.start : group.stop + 1].long()
    first_query, query_len = query_start[:-1, None], (query_start[1:] - query_start[:-1])[:, None]
    seq_len = md.seq_lens[group.start : group.stop, None].long()
    positions = torch.arange(max_len, device=device)
    blocks = md.block_tables[group.start : group.stop, : -(-max_len // block_size)].long()
    context = latents[blocks[:, positions // block_size], positions % block_size]  # [n, max_len, r + rope]
    context = context.masked_fill((positions >= seq_len)[..., None], 0.0)  # padding, NaN-free
    latent, k_pe = context.split([layer.kv_lora_rank, layer.qk_rope_head_dim], dim=-1)
    kv = layer.kv_b_proj(latent).view(len(group), max_len, layer.num_heads, -1)
    k_nope, values = kv.split([layer.qk_nope_head_dim, layer.v_head_dim], dim=-1)
    keys = torch.cat((k_nope, k_pe[:, :, None].expand(-1, -1, layer.num_heads, -1)), dim=-1)
    # Query j of a sequence is its token first_query + j at position seq_len - query_len + j. Rows
    # past its query_len repeat its last query; their position past the context sees what the
    # last query sees, so they compute its very output, and writing them back is harmless.
    j = torch.arange(max_q, device=device)
    q_rows = first_query + torch.minimum(j, query_len - 1)  # [n, max_q]
    q_pos = seq_len - query_len + j
    mask = (positions[None, None, :] <= q_pos[..., None]) & (positions < seq_len)[:, None, :]
    attended = F.scaled_dot_product_attention(
        q[q_rows].transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=layer.scale,
    )  # [n, num_heads, max_q, v_head_dim]
    output[q_rows.flatten()] = attended.transpose(1, 2).flatten(0, 1)
