"""Multi-head latent attention's GPU step (the Triton attention backend): ``MLAAttention``'s
``_step_per_sequence`` computed with every decode of the step in one launch of the MLA decode
kernel (kernels/triton/mla_decode.py). Its own module because it imports triton, an optional
dependency: ``MLAAttention`` imports it when it is built for the Triton backend.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.triton.mla_decode import check_mla_dims, mla_decode
from pagedllm.kernels.triton.reshape_and_cache import reshape_and_cache

__all__ = ["check_mla_dims", "step_paged"]


def step_paged(
    layer: nn.Module, q: torch.Tensor, entry: torch.Tensor, cache: torch.Tensor, md: AttentionMetadata
) -> torch.Tensor:
    """layer: the ``MLAAttention`` (its dims, W_UK/W_UV and per-sequence path; not imported
    here, which it imports). q: [num_tokens, num_heads, qk_head_dim] (rotated); entry:
    [num_tokens, 1, r + rope], each token's latent; cache: the layer's, the Triton layout of one KV
    head [num_blocks, 1, block_size, r + rope] (the same memory as the torch layout's [num_blocks,
    block_size, 1, r + rope]) -> [num_tokens, num_heads, v_head_dim].

    Decodes take the absorbed form: W_UK^T q_nope as one batched matmul over the heads, the
    kernel, then W_UV the same way. Prefill chunks stay expanded a sequence at a time
    (``_attend_sequences``): their cost is the expansion, 2 seq_len r H (nope + v) FLOPs a
    sequence, a few large matmuls that a batched kernel would not make cheaper. Nothing here syncs
    with the device before the prefills (the decode grid comes from ``md.max_seq_len``, a host
    int): a decode-only step is CUDA-graph capturable.
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
        layer._attend_sequences(q, cache, md, num_decodes, output)
    return output
