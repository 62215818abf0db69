"""Attention sinks (StreamingLLM, Xiao et al. 2023) in the Triton kernels and the triton and cuda
backends, against the torch oracle (itself checked against a dense reference in
tests/attention/test_attention_sinks.py).

Runs on the CPU under TRITON_INTERPRET=1 (set by conftest.py when there is no GPU), else on CUDA.
Tiny partitions and tiles, so that windows start in the first, a middle and the last partition,
sinks span less than a tile, exactly one and more than one, and chunks behind a cached context
have rows whose windows have passed no sink, some and all of them. Caches hold NaN in every slot no
sequence owns; one test also poisons every slot between the sinks and the window.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton", reason="the triton attention backend needs the triton package")

from test_cuda_layout_prefill import make_step, run_prefill
from test_triton_attention import DEVICE, Launch, PagedBatch, assert_matches, make_batch

from pagedllm.attention.backends.cuda_backend import CudaAttentionBackend
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.attention.backends.triton_backend import TritonAttentionBackend
from pagedllm.kernels.cuda.layout import reshape_and_cache_reference
from pagedllm.kernels.triton import paged_decode, paged_prefill, reshape_and_cache

# Decodes with contexts from empty to past several partitions, then a fresh prompt longer than the
# windows, chunks behind cached contexts longer than sinks + window, and a one-token chunk.
CONTEXT_LENS = [0, 3, 20, 37, 70, 99, 130, 0, 60, 110, 45]
QUERY_LENS = [1] * 7 + [40, 25, 20, 1]
NUM_DECODES = 7


def sink_query_like(query: torch.Tensor, seed: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(query.shape, generator=gen).to(query.dtype).to(query.device)


def oracle(
    batch: PagedBatch, sink_query: torch.Tensor, num_heads: int, num_kv_heads: int, head_size: int, **variants
) -> torch.Tensor:
    backend = TorchAttentionBackend(num_heads, head_size, head_size**-0.5, num_kv_heads, **variants)
    out = backend.forward(
        batch.query, batch.key, batch.value, batch.torch_caches(), batch.md, sink_query=sink_query
    )
    return out[: int(batch.md.query_start_loc_cpu[-1])]


def run_kernels(
    batch: PagedBatch, sink_query: torch.Tensor, head_size: int, max_seq_len: int, launch: Launch, **variants
) -> torch.Tensor:
    """Cache write, then paged_decode and paged_prefill with the sink query into a NaN output."""
    md = batch.md
    scale = head_size**-0.5
    reshape_and_cache(batch.key, batch.value, batch.key_cache, batch.value_cache, md.slot_mapping)
    out = torch.full_like(batch.query, float("nan"))
    nd = md.num_decodes
    if nd:
        paged_decode(
            batch.query[:nd],
            batch.key_cache,
            batch.value_cache,
            md.block_tables[:nd],
            md.seq_lens[:nd],
            scale,
            max_seq_len,
            out[:nd],
            sink_query=sink_query[:nd],
            partition_size=launch.partition_size,
            block_n=launch.decode_block_n,
            **variants,
        )
    paged_prefill(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        md.block_tables,
        md.seq_lens,
        md.query_start_loc,
        scale,
        nd,
        md.num_prefills,
        md.max_query_len,
        out,
        sink_query=sink_query,
        block_m=launch.block_m,
        block_n=launch.prefill_block_n,
        **variants,
    )
    return out[: int(md.query_start_loc_cpu[-1])]


def _slopes(num_heads: int) -> torch.Tensor:
    return torch.linspace(0.05, 0.5, num_heads).to(DEVICE)


# (id, block_size, (num_heads, num_kv_heads), variants): sinks within a tile (1, 5), exactly one
# 16-token tile and more than one (20); windows smaller than a partition and larger than a tile;
# GQA and MHA; soft cap and ALiBi.
W, S, CAP, ALIBI = "sliding_window", "attention_sinks", "logits_soft_cap", "alibi_slopes"
CASES = [
    ("W16-S4-b16-gqa", 16, (8, 2), {W: 16, S: 4}),
    ("W33-S5-b8-mha-softcap", 8, (4, 4), {W: 33, S: 5, CAP: 3.0}),
    ("W16-S16-b8-gqa-alibi", 8, (8, 2), {W: 16, S: 16, ALIBI: "slopes"}),
    ("W64-S1-b16-mha", 16, (4, 4), {W: 64, S: 1}),
    ("W5-S20-b16-gqa-all", 16, (8, 2), {W: 5, S: 20, CAP: 4.0, ALIBI: "slopes"}),
]


def _variants(variants: dict, num_heads: int) -> dict:
    return {k: _slopes(num_heads) if v == "slopes" else v for k, v in variants.items()}


@pytest.mark.parametrize("block_size, heads, variants", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kernels_match_torch(block_size: int, heads: tuple[int, int], variants: dict) -> None:
    num_heads, num_kv_heads = heads
    head_size = 64
    variants = _variants(variants, num_heads)
    batch = make_batch(
        NUM_DECODES,
        CONTEXT_LENS,
        QUERY_LENS,
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        torch.float32,
        num_padding_tokens=2,
    )
    sink_query = sink_query_like(batch.query)
    ref = oracle(batch, sink_query, num_heads, num_kv_heads, head_size, **variants)
    # A host bound above every seq_len (as under CUDA graphs): extra partitions must exit.
    out = run_kernels(batch, sink_query, head_size, max_seq_len=160, launch=Launch(), **variants)
    assert_matches(out, ref, torch.float32)


def test_single_partition_decode_and_large_tiles() -> None:
    """One partition (the output written directly) and 64-token tiles: the sinks and the window
    share the first tile."""
    variants = {"sliding_window": 33, "attention_sinks": 4}
    batch = make_batch(4, [10, 40, 90, 150, 70], [1, 1, 1, 1, 50], 8, 2, 64, 16, torch.float32)
    sink_query = sink_query_like(batch.query)
    ref = oracle(batch, sink_query, 8, 2, 64, **variants)
    launch = Launch(partition_size=256, decode_block_n=64, block_m=64, prefill_block_n=64)
    out = run_kernels(batch, sink_query, 64, max_seq_len=256, launch=launch, **variants)
    assert_matches(out, ref, torch.float32)


def test_sinks_change_the_output() -> None:
    """The comparisons can fail: without the sink stage (S = 0) the kernels differ from the oracle
    with sinks on every row whose window has passed a sink."""
    batch = make_batch(2, [3, 99], [1, 1], 4, 2, 64, 16, torch.float32)
    sink_query = sink_query_like(batch.query)
    ref = oracle(batch, sink_query, 4, 2, 64, sliding_window=16, attention_sinks=4)
    out = run_kernels(batch, sink_query, 64, max_seq_len=128, launch=Launch(), sliding_window=16)
    torch.testing.assert_close(out[0], ref[0], atol=1e-4, rtol=1e-4)  # 4 tokens: all in the window
    assert (out[1] - ref[1]).abs().amax() > 1e-2


def test_only_sinks_and_window_are_read() -> None:
    """NaN in every cached slot between the sinks and the window (blocks the engine may free):
    decodes and prefill chunks stay finite and equal to the oracle on the clean cache."""
    window, sinks, block_size = 16, 5, 8
    variants = {"sliding_window": window, "attention_sinks": sinks}
    batch = make_batch(
        NUM_DECODES, CONTEXT_LENS, QUERY_LENS, 8, 2, 64, block_size, torch.float32, num_padding_tokens=2
    )
    sink_query = sink_query_like(batch.query)
    ref = oracle(batch, sink_query, 8, 2, 64, **variants)
    tables = batch.md.block_tables.cpu()
    poisoned = 0
    for i, ctx in enumerate(CONTEXT_LENS):
        # The step's first query sits at ctx: no row sees keys in [sinks, ctx - window].
        for pos in range(sinks, ctx - window + 1):
            block, slot = int(tables[i, pos // block_size]), pos % block_size
            batch.key_cache[block, :, slot] = float("nan")
            batch.value_cache[block, :, slot] = float("nan")
            poisoned += 1
    assert poisoned > 200
    out = run_kernels(batch, sink_query, 64, max_seq_len=160, launch=Launch(), **variants)
    assert_matches(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_forward_mixed_batch(dtype: torch.dtype) -> None:
    """The backend with its own launch table: decodes, prefill chunks, then CUDA-graph padding."""
    num_heads, num_kv_heads, head_size, block_size = 8, 2, 64, 16
    variants = {"sliding_window": 24, "attention_sinks": 4, "logits_soft_cap": 5.0}
    batch = make_batch(
        3,
        [5, 40, 90, 0, 70],
        [1, 1, 1, 30, 9],
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        dtype,
        num_padding_tokens=3,
    )
    sink_query = sink_query_like(batch.query)
    ref = oracle(batch, sink_query, num_heads, num_kv_heads, head_size, **variants)
    backend = TritonAttentionBackend(num_heads, head_size, head_size**-0.5, num_kv_heads, **variants)
    caches = (batch.key_cache, batch.value_cache)
    out = backend.forward(batch.query, batch.key, batch.value, caches, batch.md, sink_query=sink_query)
    assert out.dtype == dtype
    assert_matches(out[: ref.shape[0]], ref, dtype)


def test_zero_sinks_ignore_a_sink_query() -> None:
    batch = make_batch(1, [30, 70], [1, 20], 4, 2, 64, 16, torch.float32)
    backend = TritonAttentionBackend(4, 64, 0.125, 2, sliding_window=16)
    caches = (batch.key_cache, batch.value_cache)
    plain = backend.forward(batch.query, batch.key, batch.value, caches, batch.md)
    ignored = backend.forward(
        batch.query, batch.key, batch.value, caches, batch.md, sink_query=batch.query * 7
    )
    torch.testing.assert_close(ignored, plain, atol=0, rtol=0)


@pytest.mark.parametrize("backend_cls", [TritonAttentionBackend, CudaAttentionBackend])
def test_bad_sinks_are_refused(backend_cls: type) -> None:
    with pytest.raises(ValueError, match="attention_sinks"):
        backend_cls(4, 64, 0.125, 2, sliding_window=16, attention_sinks=-2)
    with pytest.raises(ValueError, match=r"attention_sinks.*sliding_window"):
        backend_cls(4, 64, 0.125, 2, attention_sinks=4)
    batch = make_batch(1, [30], [1], 4, 2, 64, 16, torch.float32)
    backend = backend_cls(4, 64, 0.125, 2, sliding_window=16, attention_sinks=4)
    caches = (batch.key_cache, batch.value_cache)
    with pytest.raises(ValueError, match="sink_query"):
        backend.forward(batch.query, batch.key, batch.value, caches, batch.md)
    with pytest.raises(ValueError, match="sink_query"):
        backend.forward(batch.query, batch.key, batch.value, caches, batch.md, sink_query=batch.query[:, :2])


# The cuda backend: its prefill chunks, and its decodes routed through paged_prefill (one query per
# sequence), over vLLM's original layout.
CUDA_LAYOUT_VARIANTS = [
    {"sliding_window": 16, "attention_sinks": 4},
    {"sliding_window": 24, "attention_sinks": 5, "logits_soft_cap": 3.0},
]


@pytest.mark.parametrize("variants", CUDA_LAYOUT_VARIANTS, ids=["W16-S4", "W24-S5-softcap"])
def test_prefill_over_the_seeds_layout(variants: dict) -> None:
    context_lens, query_lens = [9, 70, 0, 50, 100, 45], [1, 1, 37, 25, 16, 1]
    step = make_step(2, context_lens, query_lens, 8, 2, 64, 8, torch.float32, num_padding_tokens=3)
    sink_query = sink_query_like(step.query)
    backend = TorchAttentionBackend(8, 64, 64**-0.5, 2, **variants)
    ref = backend.forward(step.query, step.key, step.value, step.torch_caches, step.md, sink_query=sink_query)
    out = run_prefill(step, 64, sink_query=sink_query, **variants)
    assert out[:2].isnan().all(), "the prefill wrote the decodes' rows"
    rows = slice(2, step.num_real_tokens)
    assert_matches(out[rows], ref[rows], torch.float32)


def test_cuda_backend_decodes_with_the_prefill_kernel() -> None:
    """CudaAttentionBackend.decode on a sink layer: paged_prefill, one query per sequence, over
    vLLM's original layout (the cache write and V1/V2 need CUDA; this path does not)."""
    variants = {"sliding_window": 16, "attention_sinks": 5}
    step = make_step(5, [0, 9, 30, 47, 99], [1] * 5, 8, 2, 64, 16, torch.float32)
    sink_query = sink_query_like(step.query)
    backend = TorchAttentionBackend(8, 64, 64**-0.5, 2, **variants)
    ref = backend.forward(step.query, step.key, step.value, step.torch_caches, step.md, sink_query=sink_query)
    reshape_and_cache_reference(step.key, step.value, *step.seeds_caches, step.md.slot_mapping)
    out = torch.full_like(step.query, float("nan"))
    cuda = CudaAttentionBackend(8, 64, 64**-0.5, 2, **variants)
    md = step.md
    cuda.decode(step.query, sink_query, *step.seeds_caches, md.block_tables, md.seq_lens, md.max_seq_len, out)
    assert_matches(out, ref, torch.float32)
    # The same rows through run_prefill's launch (first_seq 0, all of them "prefills").
    as_prefill = dataclasses.replace(step, md=dataclasses.replace(md, num_decodes=0, num_prefills=5))
    assert_matches(run_prefill(as_prefill, 64, sink_query=sink_query, **variants), ref, torch.float32)
