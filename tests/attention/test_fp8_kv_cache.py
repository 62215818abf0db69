"""The FP8 KV cache on the torch reference backend: what the cache stores, what attention reads, the
block budget, the checkpoint's scale names, and the refusals.

The oracle quantizes K/V itself (``fake_quant``: divide by the scale, saturate to ±448, round with
torch's own float8_e4m3fn cast, multiply back) and attends in float32 over float32 caches.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedllm.attention.backends.cpu_backend import CpuAttentionBackend
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.attention.kv_quant import check_kv_cache_dtype
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import CacheConfig
from pagedllm.models.kv_scales import kv_scale_target
from pagedllm.worker.cache_engine import CacheEngine, KVCacheSpec

E4M3_MAX = 448.0


def e4m3_values(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 cache with ``scale`` stores for x: saturate(x / scale) in e4m3, as float32."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def fake_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an FP8 cache with ``scale`` gives it back, in float32."""
    return e4m3_values(x, scale) * scale


def _metadata(context_lens: list[int], query_lens: list[int], num_decodes: int, block_size: int):
    """Block tables (shuffled blocks) and slots for sequences of context + query tokens, all of
    whose tokens are written this step (the cache starts empty)."""
    gen = torch.Generator().manual_seed(1)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(sum(blocks) + 2, generator=gen)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[first : first + n]
        first += n
    query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)

    def slots(i: int, positions: range) -> torch.Tensor:
        pos = torch.tensor(list(positions), dtype=torch.long)
        return tables[i, pos // block_size].long() * block_size + pos % block_size

    context_slots = [slots(i, range(c)) for i, c in enumerate(context_lens)]
    new_slots = torch.cat(
        [slots(i, range(c, c + q)) for i, (c, q) in enumerate(zip(context_lens, query_lens))]
    )
    md = AttentionMetadata(
        num_decodes=num_decodes,
        num_prefills=len(seq_lens) - num_decodes,
        slot_mapping=new_slots,
        query_start_loc=query_start,
        seq_lens=seq_lens_t,
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens_t,
    )
    return md, context_slots, sum(blocks) + 2


@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.01, 0.05), (3.0, 0.5)])
def test_torch_backend_fp8_cache_matches_float32_over_quantized_kv(k_scale: float, v_scale: float) -> None:
    """Two decodes over cached contexts and a prefill chunk after a cached prefix: the cache
    holds exactly the oracle's e4m3 bytes (saturated where x / scale passes 448), and the output
    is float32 attention over the oracle's dequantized K/V."""
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 16, 4
    context_lens, query_lens = [9, 5, 6], [1, 1, 7]
    md, context_slots, num_blocks = _metadata(context_lens, query_lens, 2, block_size)
    gen = torch.Generator().manual_seed(0)
    num_tokens = sum(query_lens)
    # Magnitudes up to ~12: with scale 0.01 most of K passes 448 * 0.01 and saturates.
    heads = (num_heads, num_kv_heads, num_kv_heads)
    q, k, v = (torch.randn(num_tokens, h, head_size, generator=gen) * 3 for h in heads)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    fp8 = [torch.zeros(shape, dtype=torch.float8_e4m3fn) for _ in range(2)]
    ref = [torch.zeros(shape) for _ in range(2)]
    # The cached contexts, written as a previous step's cache write would have.
    for slots in context_slots:
        for cache_fp8, cache_ref, scale in zip(fp8, ref, (k_scale, v_scale)):
            x = torch.randn(len(slots), num_kv_heads, head_size, generator=gen) * 3
            flat = cache_fp8.view(-1, num_kv_heads, head_size)
            fp8_bytes = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
            flat.view(torch.uint8)[slots] = fp8_bytes
            cache_ref.view(-1, num_kv_heads, head_size)[slots] = fake_quant(x, scale)

    backend = TorchAttentionBackend(num_heads, head_size, head_size**-0.5, num_kv_heads)
    backend.k_scale.fill_(k_scale)
    backend.v_scale.fill_(v_scale)
    out = backend.forward(q, k, v, (fp8[0], fp8[1]), md)

    oracle = TorchAttentionBackend(num_heads, head_size, head_size**-0.5, num_kv_heads)
    expected = oracle.forward(q, fake_quant(k, k_scale), fake_quant(v, v_scale), (ref[0], ref[1]), md)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    # The bytes of this step's tokens: saturate(x / scale) in e4m3.
    for cache, x, scale in zip(fp8, (k, v), (k_scale, v_scale)):
        stored = cache.view(-1, num_kv_heads, head_size).view(torch.uint8)[md.slot_mapping]
        stored = stored.view(torch.float8_e4m3fn).float()
        assert stored.abs().max() <= E4M3_MAX and not stored.isnan().any()
        torch.testing.assert_close(stored, e4m3_values(x, scale), atol=0, rtol=0)
    if k_scale == 0.01:
        assert (fp8[0].float().abs() == E4M3_MAX).any(), "the case meant to saturate did not"


def test_fp8_cache_is_close_to_the_unquantized_one() -> None:
    """e4m3 keeps 3 mantissa bits: attention over it stays within a few percent of float32."""
    num_heads, num_kv_heads, head_size, block_size = 2, 1, 32, 8
    md, _, num_blocks = _metadata([0], [20], 0, block_size)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(20, h, head_size, generator=gen) for h in (num_heads, num_kv_heads, num_kv_heads))
    backend = TorchAttentionBackend(num_heads, head_size, head_size**-0.5, num_kv_heads)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    fp8_caches = tuple(torch.zeros(shape, dtype=torch.float8_e4m3fn) for _ in range(2))
    out_fp8 = backend.forward(q, k, v, fp8_caches, md)
    out_f32 = backend.forward(q, k, v, tuple(torch.zeros(shape) for _ in range(2)), md)
    assert not torch.equal(out_fp8, out_f32)
    torch.testing.assert_close(out_fp8, out_f32, atol=0.08, rtol=0.08)


def test_fp8_block_holds_half_the_bytes_of_bf16() -> None:
    """KVCacheSpec.block_bytes (what the profiler and kv_cache_memory divide by) per dtype."""
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.bfloat16)
    fp8 = dataclasses.replace(spec, dtype=torch.float8_e4m3fn)
    assert spec.block_bytes == 2 * 3 * 16 * 2 * 64 * 2
    assert fp8.block_bytes * 2 == spec.block_bytes


@pytest.mark.parametrize(
    "name, expected",
    [
        ("model.layers.3.self_attn.k_scale", ("model.layers.3.self_attn", ("k_scale",))),
        ("model.layers.3.self_attn.v_scale", ("model.layers.3.self_attn", ("v_scale",))),
        ("model.layers.0.self_attn.kv_scale", ("model.layers.0.self_attn", ("k_scale", "v_scale"))),
        ("model.layers.1.self_attn.k_proj.k_scale", ("model.layers.1.self_attn", ("k_scale",))),
        ("model.layers.1.self_attn.v_proj.output_scale", ("model.layers.1.self_attn", ("v_scale",))),
        ("model.layers.1.self_attn.k_proj.weight_scale", None),
        ("model.layers.1.self_attn.k_proj.input_scale", None),
        ("model.layers.1.self_attn.q_proj.weight", None),
    ],
)
def test_checkpoint_scale_names(name: str, expected) -> None:
    assert kv_scale_target(name) == expected


def test_kv_cache_dtype_values() -> None:
    assert CacheConfig(cache_dtype="fp8").cache_dtype == "fp8"
    assert CacheConfig(cache_dtype="fp8_e4m3").cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2' is not supported"):
        CacheConfig(cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(cache_dtype="int8")


def test_backends_without_fp8_kernels_refuse_by_name() -> None:
    check_kv_cache_dtype(TorchAttentionBackend, torch.float8_e4m3fn)
    check_kv_cache_dtype(CpuAttentionBackend, torch.float32)
    with pytest.raises(ValueError, match="not supported by the 'cpu' attention backend"):
        check_kv_cache_dtype(CpuAttentionBackend, torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float32])
def test_cache_engine_moves_fp8_blocks_as_they_are(dtype: torch.dtype) -> None:
    """Block copies (copy-on-write of a shared prefix block) and swaps keep every byte."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype=dtype)
    engine = CacheEngine(spec, TorchAttentionBackend, 6, 2, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for layer in engine.gpu_cache:
        for tensor in layer:
            data = tensor.view(torch.uint8)
            data.copy_(torch.randint(0, 0x7F, data.shape, generator=gen))
    before = [[t.view(torch.uint8).clone() for t in layer] for layer in engine.gpu_cache]
    engine.run_cache_ops([(1, 0)], [], [(2, 5)])
    engine.run_cache_ops([], [(0, 4)], [])
    for layer, old in zip(engine.gpu_cache, before):
        for tensor, original in zip(layer, old):
            data = tensor.view(torch.uint8)
            assert torch.equal(data[5], original[2]) and torch.equal(data[4], original[1])
            assert torch.equal(data[:4], original[:4])
