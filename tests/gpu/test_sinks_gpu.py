"""Attention sinks (StreamingLLM, Xiao et al. 2023) on CUDA: the triton and cuda backends against
the torch oracle on random inputs at realistic sizes, float32 and bfloat16.

Batches mix decodes (contexts from shorter than the window to thousands of tokens) and prefill
chunks behind long cached contexts; every slot no sequence owns holds NaN, and so does every
cached slot between the sinks and the window (the blocks an engine with sinks frees), so a kernel
that reads one fails loudly. The oracle runs on the clean caches. A windowed decode with sinks is
also captured in a CUDA graph and replayed with longer lengths.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton kernels", allow_module_level=True)
pytest.importorskip("triton", reason="the triton attention backend needs the triton package")

from test_cuda_kernels import Batch, make_batch  # tests/gpu helpers

from pagedllm.attention.backends.cuda_backend import CudaAttentionBackend
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.attention.backends.triton_backend import TritonAttentionBackend
from pagedllm.kernels.cuda.layout import from_triton_layout, to_triton_layout

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
SHAPE = {"num_heads": 32, "num_kv_heads": 8, "head_size": 128, "block_size": 16}
VARIANTS = {"sliding_window": 512, "attention_sinks": 4}


def sink_step(dtype: torch.dtype, seed: int, num_padding_tokens: int = 0) -> tuple[Batch, torch.Tensor]:
    """Decodes, then prefill chunks (a fresh prompt longer than the window, chunks behind long
    contexts, one token), then padding; and the sink query."""
    gen = torch.Generator().manual_seed(seed)
    num_decodes = 24
    context_lens = [
        0,
        3,
        300,
        511,
        512,
        513,
        *torch.randint(600, 4000, (num_decodes - 6,), generator=gen).tolist(),
    ]
    context_lens += [0, 1500, 2900, 700]
    query_lens = [1] * num_decodes + [700, 300, 77, 1]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    batch = make_batch(
        seq_lens,
        query_lens,
        num_decodes,
        dtype=dtype,
        num_padding_tokens=num_padding_tokens,
        seed=seed,
        **SHAPE,
    )
    sink_query = torch.randn(
        batch.query.shape, generator=torch.Generator(DEVICE).manual_seed(seed), device=DEVICE
    )
    return batch, sink_query.to(dtype)


def oracle(batch: Batch, sink_query: torch.Tensor, **variants) -> torch.Tensor:
    backend = TorchAttentionBackend(
        batch.num_heads, batch.head_size, batch.scale, batch.num_kv_heads, **variants
    )
    caches = tuple(c.clone() for c in batch.torch_caches)
    out = backend.forward(batch.query, batch.key, batch.value, caches, batch.md, sink_query=sink_query)
    return out[: batch.num_real_tokens]


def poison_between_sinks_and_window(
    batch: Batch, window: int, sinks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN in every cached slot no query of the step sees; returns the caches in the Triton layout
    and rewrites batch.caches (vLLM's original layout) from them."""
    key_cache, value_cache = to_triton_layout(*batch.caches)
    block_size = key_cache.shape[2]
    md = batch.md
    for i, seq_len in enumerate(md.seq_lens_cpu.tolist()):
        first_query = seq_len - int(md.query_start_loc_cpu[i + 1] - md.query_start_loc_cpu[i])
        pos = torch.arange(sinks, max(first_query - window + 1, sinks), device=DEVICE)
        blocks = md.block_tables[i, pos // block_size].long()
        for cache in (key_cache, value_cache):
            cache[blocks, :, pos % block_size] = float("nan")
    batch.caches = from_triton_layout(key_cache, value_cache)
    return key_cache, value_cache


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} NaN outputs"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend_cls", [TritonAttentionBackend, CudaAttentionBackend])
def test_sinks_match_torch(backend_cls: type, dtype: torch.dtype) -> None:
    batch, sink_query = sink_step(dtype, seed=1, num_padding_tokens=5)
    ref = oracle(batch, sink_query, **VARIANTS)
    triton_caches = poison_between_sinks_and_window(
        batch, VARIANTS["sliding_window"], VARIANTS["attention_sinks"]
    )
    caches = triton_caches if backend_cls is TritonAttentionBackend else batch.caches
    backend_cls.check_supported(batch.head_size, 16, dtype, DEVICE)
    backend = backend_cls(batch.num_heads, batch.head_size, batch.scale, batch.num_kv_heads, **VARIANTS)
    out = backend.forward(batch.query, batch.key, batch.value, caches, batch.md, sink_query=sink_query)
    torch.cuda.synchronize()
    assert_matches(out[: batch.num_real_tokens], ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_with_soft_cap_and_alibi(dtype: torch.dtype) -> None:
    variants = {
        "sliding_window": 100,
        "attention_sinks": 20,
        "logits_soft_cap": 30.0,
        "alibi_slopes": torch.linspace(0.001, 0.05, SHAPE["num_heads"], device=DEVICE),
    }
    batch, sink_query = sink_step(dtype, seed=2)
    ref = oracle(batch, sink_query, **variants)
    caches = poison_between_sinks_and_window(batch, 100, 20)
    backend = TritonAttentionBackend(
        batch.num_heads, batch.head_size, batch.scale, batch.num_kv_heads, **variants
    )
    out = backend.forward(batch.query, batch.key, batch.value, caches, batch.md, sink_query=sink_query)
    torch.cuda.synchronize()
    assert_matches(out[: batch.num_real_tokens], ref, dtype)


@pytest.mark.parametrize("backend_cls", [TritonAttentionBackend, CudaAttentionBackend])
def test_sink_decode_replays_in_a_cuda_graph(backend_cls: type) -> None:
    """Capture a windowed decode with sinks at short lengths, replay it at the real ones."""
    seq_lens = [100 + 211 * i for i in range(16)]
    batch = make_batch(seq_lens, [1] * 16, 16, dtype=torch.bfloat16, max_seq_len=4096, **SHAPE)
    sink_query = torch.randn(batch.query.shape, device=DEVICE).to(torch.bfloat16)
    ref = oracle(batch, sink_query, **VARIANTS)
    caches = batch.caches if backend_cls is CudaAttentionBackend else to_triton_layout(*batch.caches)
    final_seq_lens, final_slots = batch.md.seq_lens.clone(), batch.md.slot_mapping.clone()
    batch.md.seq_lens.fill_(100)
    batch.md.slot_mapping.fill_(-1)  # the warm-up and capture must not write the cache
    backend = backend_cls(batch.num_heads, batch.head_size, batch.scale, batch.num_kv_heads, **VARIANTS)

    def forward() -> torch.Tensor:
        return backend.forward(batch.query, batch.key, batch.value, caches, batch.md, sink_query=sink_query)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = forward()

    batch.md.seq_lens.copy_(final_seq_lens)
    batch.md.slot_mapping.copy_(final_slots)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(graph_out, ref, torch.bfloat16)
