"""The Triton kernels over an FP8 KV cache (kv_cache_dtype="fp8"): the cache write stores
saturate(x / scale) in e4m3, decode and prefill attend over k * k_scale and v * v_scale.

Oracle: K/V quantized by torch's own float8_e4m3fn cast (``fake_quant``), then the torch backend's
float32 attention over float32 caches. Runs under TRITON_INTERPRET=1 on the CPU (conftest.py),
else on CUDA; tiny shapes, tiles and partitions so that every stage runs (several partitions, tails
mid-block, a cached prefix under a prefill chunk).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="the triton attention backend needs the triton package")

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.attention.backends.triton_backend import TritonAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.triton import paged_decode, paged_prefill, reshape_and_cache

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")

E4M3_MAX = 448.0
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 64, 8
# Two decodes over 20 and 37 cached tokens, then prefill chunks of 9 (no prefix) and 5 (after 13).
CONTEXT_LENS, QUERY_LENS, NUM_DECODES = [20, 37, 0, 13], [1, 1, 9, 5], 2
K_SCALE, V_SCALE = 0.01, 0.2
# (atol, rtol) against the float32 oracle over the same quantized K/V: float32 dots are exact;
# float16 rounds q and p to float16 (the e4m3 tiles widen to it exactly).
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 4e-3)}


def e4m3_values(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 cache with ``scale`` stores for x: saturate(x / scale) in e4m3, as float32."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def fake_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an FP8 cache with ``scale`` gives it back, in float32."""
    return e4m3_values(x, scale) * scale


def _batch(dtype: torch.dtype):
    """(query, key, value, FP8 Triton-layout caches holding the contexts (NaN bytes elsewhere),
    float32 torch-layout caches of the same dequantized contexts, metadata)."""
    gen = torch.Generator().manual_seed(0)
    seq_lens = [c + q for c, q in zip(CONTEXT_LENS, QUERY_LENS)]
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[first : first + n]
        first += n

    def slots(i: int, positions: range) -> torch.Tensor:
        pos = torch.tensor(list(positions), dtype=torch.int64)
        return tables[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE

    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
    fp8 = [torch.full(shape, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn) for _ in range(2)]  # NaN
    ref = [torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE) for _ in range(2)]
    for i, ctx in enumerate(CONTEXT_LENS):
        s = slots(i, range(ctx))
        for cache, cache_ref, scale in zip(fp8, ref, (K_SCALE, V_SCALE)):
            # Up to ~9: with K_SCALE 0.01 much of K saturates at 448.
            x = torch.randn(ctx, NUM_KV_HEADS, HEAD_SIZE, generator=gen) * 3
            fp8_bytes = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
            cache.view(torch.uint8)[s // BLOCK_SIZE, :, s % BLOCK_SIZE] = fp8_bytes
            cache_ref[s // BLOCK_SIZE, s % BLOCK_SIZE] = fake_quant(x, scale)
    new_tokens = enumerate(zip(CONTEXT_LENS, QUERY_LENS))
    slot_mapping = torch.cat([slots(i, range(c, c + q)) for i, (c, q) in new_tokens])
    num_tokens = slot_mapping.shape[0]
    query_start = torch.tensor([0, *torch.tensor(QUERY_LENS).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    md = AttentionMetadata(
        num_decodes=NUM_DECODES,
        num_prefills=len(seq_lens) - NUM_DECODES,
        slot_mapping=slot_mapping.to(DEVICE),
        query_start_loc=query_start.to(DEVICE),
        seq_lens=seq_lens_t.to(DEVICE),
        block_tables=tables.to(DEVICE),
        max_query_len=max(QUERY_LENS),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens_t,
    )
    q, k, v = (
        (torch.randn(num_tokens, h, HEAD_SIZE, generator=gen) * 3).to(dtype).to(DEVICE)
        for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)
    )
    return q, k, v, [c.to(DEVICE) for c in fp8], [c.to(DEVICE) for c in ref], md


def _oracle(q, fp8_caches, ref_caches, md) -> torch.Tensor:
    """Float32 attention over the quantized contexts and this step's K/V as the cache write
    stored them (read back and dequantized: the write's rounding is the other test's subject, and
    the interpreter rounds some values differently, see ``_interpreter_rounding``)."""
    s = md.slot_mapping
    k, v = (
        c.view(torch.uint8)[s // BLOCK_SIZE, :, s % BLOCK_SIZE].view(torch.float8_e4m3fn).float() * scale
        for c, scale in zip(fp8_caches, (K_SCALE, V_SCALE))
    )
    backend = TorchAttentionBackend(NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, NUM_KV_HEADS)
    return backend.forward(q.float(), k, v, tuple(ref_caches), md)


def _interpreter_rounding(stored: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Where Triton's interpreter (3.9) rounds float -> e4m3 unlike compiled kernels (PTX's
    cvt.rn: to nearest, ties to even) and torch: ties go away from zero (200 -> 208, not 192), a
    value rounded up to a power of two loses the carry into the exponent (-127.9 -> -64, not
    -128), subnormals may land a step off. So under the interpreter a stored value may be one
    e4m3 step (2^(exponent - 3), 2^-9 below 2^-6) from torch's, or half a power of two; off it,
    False everywhere: the comparison is exact."""
    if not INTERPRET:
        return torch.zeros_like(stored, dtype=torch.bool)
    magnitude = expected.abs()
    mantissa, exponent = torch.frexp(magnitude)
    power_of_two = (magnitude > 0) & (mantissa == 0.5)
    lost_carry = power_of_two & (stored == expected / 2)
    step = torch.where(magnitude < 2**-6, 2.0**-9, torch.ldexp(torch.ones_like(magnitude), exponent - 4))
    return lost_carry | ((stored - expected).abs() <= step)


def _scales() -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(K_SCALE, device=DEVICE), torch.tensor(V_SCALE, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache_write_stores_saturated_e4m3(dtype: torch.dtype) -> None:
    _, k, v, (key_cache, value_cache), _, md = _batch(dtype)
    reshape_and_cache(k, v, key_cache, value_cache, md.slot_mapping, kv_scales=_scales())
    s = md.slot_mapping.cpu()
    for cache, x, scale in ((key_cache, k, K_SCALE), (value_cache, v, V_SCALE)):
        stored = cache.cpu().view(torch.uint8)[s // BLOCK_SIZE, :, s % BLOCK_SIZE]
        stored = stored.view(torch.float8_e4m3fn).float()
        expected = e4m3_values(x.cpu(), scale)
        exact = (stored == expected) | _interpreter_rounding(stored, expected)
        assert exact.all(), f"{int((~exact).sum())} stored values are not saturate(x / scale) in e4m3"
        assert (stored == expected).float().mean() > 0.97
    assert (key_cache.cpu().float().abs() == E4M3_MAX).any(), "K_SCALE is meant to saturate some of K"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_decode_and_prefill_match_float32_over_quantized_kv(dtype: torch.dtype) -> None:
    q, k, v, (key_cache, value_cache), ref_caches, md = _batch(dtype)
    k_scale, v_scale = _scales()
    reshape_and_cache(k, v, key_cache, value_cache, md.slot_mapping, kv_scales=(k_scale, v_scale))
    out = torch.full_like(q, float("nan"))
    nd, scale = md.num_decodes, HEAD_SIZE**-0.5
    paged_decode(
        q[:nd], key_cache, value_cache, md.block_tables[:nd], md.seq_lens[:nd], scale, md.max_seq_len,
        out[:nd], k_scale=k_scale, v_scale=v_scale, partition_size=16, block_n=16,
    )  # fmt: skip
    paged_prefill(
        q, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale, nd,
        md.num_prefills, md.max_query_len, out, k_scale=k_scale, v_scale=v_scale, block_m=16, block_n=16,
    )  # fmt: skip
    assert not out.isnan().any()
    atol, rtol = TOLERANCES[dtype]
    expected = _oracle(q, (key_cache, value_cache), ref_caches, md)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


def test_triton_backend_forward_reads_its_layer_scales() -> None:
    """The backend passes the layer's k_scale / v_scale (filled in place, as the loader does) to
    all three kernels."""
    q, k, v, caches, ref_caches, md = _batch(torch.float32)
    backend = TritonAttentionBackend(NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, NUM_KV_HEADS)
    backend.k_scale = backend.k_scale.to(DEVICE).fill_(K_SCALE)
    backend.v_scale = backend.v_scale.to(DEVICE).fill_(V_SCALE)
    out = backend.forward(q, k, v, tuple(caches), md)
    torch.testing.assert_close(out, _oracle(q, caches, ref_caches, md), atol=1e-4, rtol=1e-4)
