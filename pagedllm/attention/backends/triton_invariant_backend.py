"""The batch-invariant Triton attention backend (``batch_invariant=True`` on CUDA; docs/determinism.md).

The default Triton step attends with two kernels whose sums differ: ``paged_decode`` splits a
context into partitions sized by the batch (``launch.decode_partition_size``) and packs a GQA
group into its rows, ``paged_prefill`` walks the context in ``BLOCK_N`` tiles per query head. So a
token's attention output depends on whether it was decoded or prefilled, and on its batch.

Here one kernel serves every query: ``paged_prefill`` over all the step's sequences, a decode
being a query of length 1. It reads the whole context from the paged cache, after this step's K/V
is written, and a query row's online softmax walks key tiles ``[0, BLOCK_N), [BLOCK_N, 2 BLOCK_N),
...`` of absolute positions, in order, with no split of the context: the same tiles whether the
keys came from the prefix cache, an earlier chunk or this one, and whichever rows share the
program's ``BLOCK_M`` tile (a row's dot products and row reductions do not read its neighbours;
tiles past its position are fully masked, adding exact zeros with a rescale by exactly 1). One
launch configuration for every batch (``invariant_launch``), and no FMA contraction, so a tile
gives the same bits in the kernel's unmasked stage and in its masked one (which stage a tile falls
in depends on where the program's rows start).

Cost: a decode program computes ``BLOCK_M = 16`` query rows for one (``tl.dot`` needs 16), and a
context is not split across SMs, which a batch of one long context would want.
"""

from __future__ import annotations

import functools
from dataclasses import asdict

import torch

from pagedllm.attention.backends.abstract import KVCache
from pagedllm.attention.backends.triton_backend import TritonAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.triton import paged_prefill
from pagedllm.kernels.triton.launch import PrefillLaunch


@functools.cache
def invariant_launch(head_size: int, dtype: torch.dtype) -> dict[str, int]:
    """The one launch of a model's layers (a function of head size and dtype, never of the batch):
    16-row query tiles, the smallest ``tl.dot`` takes (a decode uses one row of it); key tiles as
    the default prefill's (``launch.default_launches``)."""
    block_n = 32 if head_size > 128 or dtype == torch.float32 else 64
    return asdict(PrefillLaunch(block_m=16, block_n=block_n, num_warps=4, num_stages=2))


class TritonInvariantAttentionBackend(TritonAttentionBackend):
    """The Triton layout and cache write; one ``paged_prefill`` launch over the whole step."""

    name = "triton_invariant"

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
        sink_query = self._check_sink_query(query, sink_query)
        md = attn_metadata
        query = self.write_cache(query, key, value, kv_cache, md.slot_mapping, positions)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        key_cache, value_cache = kv_cache
        paged_prefill(
            query,
            key_cache,
            value_cache,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            self.scale,
            0,
            md.num_seqs,
            max(md.max_query_len, 1),
            output,
            sink_query=sink_query,
            **self.kernel_variants,
            **invariant_launch(self.head_size, key_cache.dtype),
            enable_fp_fusion=False,
        )
        return output
