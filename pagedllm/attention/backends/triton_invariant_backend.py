"""The batch-invariant Triton attention backend (``batch_invariant=True`` on CUDA; docs/determinism.md).

The default Triton step attends with two kernels whose sums differ: ``paged_decode`` splits a
context into partitions sized by the batch (``launch.decode_partition_size``) and packs a GQA
group into its rows, ``paged_prefill`` walks the context in ``BLOCK_N`` tiles per query head. So a
token's attention output depends on whether it was decoded or prefilled, and on its batch.

Here one kernel serves every query: ``paged_prefill``, a decode being a query of length 1
(launched twice a step, for the decodes and for the prefill chunks, so that the grid of each fits
its longest query; the prefill chunks run query tiles of twice the rows, ``PREFILL_BLOCK_M``, which
sum alike). It reads the whole context from the paged cache, after this step's K/V is written, and
a query row's online softmax walks key tiles ``[0, BLOCK_N), [BLOCK_N, 2 BLOCK_N), ...`` of
absolute positions, in order, with no split of the context: the same tiles whether the keys came
from the prefix cache, an earlier chunk or this one, and whichever rows share the program's
``BLOCK_M`` tile (a row's dot products and row reductions do not read its neighbours; tiles past
its position are fully masked, adding exact zeros with a rescale by exactly 1). The launch
configurations follow the head size and dtype, never the batch (``invariant_launch``), and there
is no FMA contraction, so a tile gives the same bits in the kernel's unmasked stage and in its
masked one (which stage a tile falls in depends on where the program's rows start; compiled for
sm_90 with contraction, the kernel has 12 ``fma.rn.f32``, without it none).

Cost: a decode program computes ``BLOCK_M = 16`` query rows for the ``NUM_QUERIES_PER_KV`` it
needs (``tl.dot`` needs 16), and a context is not split across SMs, which a batch of one long
context would want.
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

# Rows of a prefill launch's query tiles at 16-bit dtypes. Tiles of 16 and 32 rows run the same
# MMA (m16n8k16, a 16-row slice per warp) and sum each row in the same order: the same bits (H200,
# 2026-11-28: every output of 64 prompts of 256 tokens at W1's shape, and
# tests/kernels/test_batch_invariant_attention.py at head sizes 64 to 256), and 32 rows read each
# K/V tile for twice the queries (W1's prefill attention: 321 against 394 us a layer). From 64 rows
# Triton runs Hopper's wgmma, whose sums differ in the last bit (max 0.004 in bf16).
PREFILL_BLOCK_M = 32


@functools.cache
def invariant_launch(head_size: int, dtype: torch.dtype, prefill: bool = False) -> dict[str, int | bool]:
    """``paged_prefill``'s keyword arguments for a model's layers (a function of head size and
    dtype, never of the batch): 16-row tiles, the smallest ``tl.dot`` takes, holding (token, head)
    pairs of a KV group (``pack_gqa``: a decode fills the group's rows, which share each K/V tile
    read), or for the step's prefill chunks at 16-bit dtypes ``PREFILL_BLOCK_M`` rows, which give
    the same bits; key tiles as the default prefill's (``launch.default_launches``); no FMA
    contraction (module docstring)."""
    block_n = 32 if head_size > 128 or dtype == torch.float32 else 64
    block_m = PREFILL_BLOCK_M if prefill and dtype in (torch.float16, torch.bfloat16) else 16
    launch = asdict(PrefillLaunch(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2))
    return {**launch, "enable_fp_fusion": False, "pack_gqa": True}


class TritonInvariantAttentionBackend(TritonAttentionBackend):
    """The Triton layout and cache write; one ``paged_prefill`` launch over the whole step."""

    name = "triton_invariant"
    # Its one kernel reads the model dtype (EngineConfig refuses batch_invariant with an FP8 cache).
    supports_fp8_kv_cache = False
    # Its forward writes the cache, then runs its one kernel.
    appends_in_decode = False

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
        sink_query = self._check_sink_query(query, sink_query) if self.attention_sinks else None
        md = attn_metadata
        query = self.write_cache(query, key, value, kv_cache, md.slot_mapping, positions)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        # Two launches of the one kernel, as the default step makes two: the grid's query-block axis
        # is sized by the longest query of the launch, so the decodes, beside a long chunk, would
        # otherwise fill the grid with programs that exit at once.
        if md.num_decodes:
            self._attend(query, sink_query, kv_cache, md, (0, md.num_decodes, 1), output)
        if md.num_prefills:
            seqs = (md.num_decodes, md.num_prefills, md.max_query_len)
            self._attend(query, sink_query, kv_cache, md, seqs, output, prefill=True)
        return output

    def _attend(
        self,
        query: torch.Tensor,
        sink_query: torch.Tensor | None,
        kv_cache: KVCache,
        md: AttentionMetadata,
        seqs: tuple[int, int, int],
        out: torch.Tensor,
        prefill: bool = False,
    ) -> None:
        """paged_prefill over sequences ``seqs = (first, count, max_query_len)``: their rows of out."""
        key_cache, value_cache = kv_cache
        first_seq, num_seqs, max_query_len = seqs
        paged_prefill(
            query,
            key_cache,
            value_cache,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            self.scale,
            first_seq,
            num_seqs,
            max_query_len,
            out,
            sink_query=sink_query,
            **self.kernel_variants,
            **invariant_launch(self.head_size, key_cache.dtype, prefill),
        )
