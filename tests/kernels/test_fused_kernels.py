"""The fused Triton kernels (RMSNorm with and without the residual add, in Llama's and Gemma's
orders, rotary of whole heads and of a part of each, rotary fused into the KV cache write,
SiLU-and-multiply, gated attention's sigmoid output gate) against their layers' torch paths.

Runs on the CPU under TRITON_INTERPRET=1 (set by conftest.py when there is no GPU), else on CUDA.
Outputs the kernels allocate are passed in poisoned with NaN, so an element left unwritten fails;
in-place results are checked to land in the input buffers. tests/gpu/test_fused_gpu.py runs the
same comparisons through the layers' dispatch on CUDA, bfloat16 included.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need the triton package")

from pagedllm.attention.backends.torch_backend import write_to_paged_cache
from pagedllm.kernels.triton.activation import silu_and_mul
from pagedllm.kernels.triton.reshape_and_cache import reshape_and_cache
from pagedllm.kernels.triton.rms_norm import fused_add_rms_norm, rms_norm
from pagedllm.kernels.triton.rotary import rotary_embedding
from pagedllm.kernels.triton.sigmoid_gate import sigmoid_gate
from pagedllm.layers.activation import SigmoidGate, SiluAndMul
from pagedllm.layers.layernorm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.rotary_embedding import RotaryEmbedding

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")

# Triton's interpreter stores bfloat16 as raw uint16 and computes on the bit patterns (see
# test_triton_attention.py); tests/gpu covers bfloat16 on the device.
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(INTERPRET, reason="Triton's interpreter has no bfloat16 arithmetic"),
    ),
]
# (atol, rtol) against the torch path: float32 differs only in summation order and rsqrt/exp
# rounding; 16-bit by at most an ulp of the final rounding.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1e-2)}
HIDDEN_SIZES = [64, 576, 4096]
NUM_TOKENS = [1, 7, 33]


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} elements unwritten (NaN)"
    atol, rtol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def _norm(hidden_size: int, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(hidden_size, eps=1e-5).to(DEVICE, dtype)
    norm.weight.copy_(1.0 + 0.2 * torch.randn(hidden_size, generator=gen))
    return norm


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("hidden_size", HIDDEN_SIZES)
def test_rms_norm(hidden_size: int, num_tokens: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(hidden_size + num_tokens)
    norm = _norm(hidden_size, dtype, gen)
    x = _randn(num_tokens, hidden_size, dtype=dtype, gen=gen)
    x_before = x.clone()
    out = torch.full_like(x, float("nan"))
    assert rms_norm(x, norm.weight, norm.eps, out=out) is out
    _assert_close(out, norm.forward_torch(x_before))
    assert torch.equal(x, x_before), "the input must be left unchanged"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("hidden_size", HIDDEN_SIZES)
def test_fused_add_rms_norm_writes_in_place(hidden_size: int, num_tokens: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(hidden_size * num_tokens)
    norm = _norm(hidden_size, dtype, gen)
    x = _randn(num_tokens, hidden_size, dtype=dtype, gen=gen)
    residual = _randn(num_tokens, hidden_size, dtype=dtype, gen=gen)
    ref_out, ref_residual = norm.forward_torch(x, residual)
    out, new_residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    # The sum is one rounding of the same two numbers in both paths: it must match exactly.
    assert torch.equal(new_residual, ref_residual)
    _assert_close(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128])
def test_rms_norm_over_heads_of_a_fused_qkv_view(head_size: int, dtype: torch.dtype) -> None:
    """Qwen3's q/k norms: [num_tokens, num_heads, head_size] views whose rows are strided."""
    gen = torch.Generator().manual_seed(head_size)
    num_tokens, num_heads, num_kv_heads = 7, 4, 2
    norm = _norm(head_size, dtype, gen)
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, gen=gen)
    q = qkv[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    rms_norm(q, norm.weight, norm.eps, out=out)
    _assert_close(out, norm.forward_torch(q))


# Gemma's order as Qwen3-Next and Gemma call it: [num_tokens, hidden_size] rows (a 2,048-wide
# model's, and small ones), and [num_tokens, num_heads, head_size] heads of a fused QKV output.
GEMMA_SHAPES = [(1, 2048), (33, 2048), (7, 64), (7, 4, 256), (3, 8, 64)]


def _gemma_norm(hidden_size: int, dtype: torch.dtype, gen: torch.Generator) -> GemmaRMSNorm:
    norm = GemmaRMSNorm(hidden_size, eps=1e-6).to(DEVICE, dtype)
    norm.weight.copy_(0.2 * torch.randn(hidden_size, generator=gen))  # the scale's offset from 1
    return norm


def _gemma_input(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Rows as the model passes them: [num_tokens, hidden_size] whole, or the query heads of
    Qwen3-Next's fused QKV output, each followed by its gate (rows strided within and across
    tokens, as the q/k norms read them)."""
    if len(shape) == 2:
        return _randn(*shape, dtype=dtype, gen=gen)
    num_tokens, num_heads, head_size = shape
    qkv = _randn(num_tokens, (2 * num_heads + 2) * head_size, dtype=dtype, gen=gen)
    q_gate = qkv[:, : 2 * num_heads * head_size].view(num_tokens, num_heads, 2 * head_size)
    return q_gate[..., :head_size]


def _assert_gemma_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32 within the usual tolerance; 16 bits within one ulp, and equal almost everywhere.

    The kernel reduces the float32 sum of squares in another order than torch (and its rsqrt may
    round differently), so the float32 rows differ in their last bits. Both round to 16 bits once,
    after the product with ``1 + weight``: the results are equal except where the float32 values
    straddle a rounding boundary, and there one ulp apart (bf16 on an H200: 3 in a million;
    fp16 under the interpreter: 1 in 70,000). Casting before the product (Llama's order) would
    move about 1 in 4: the share of unequal results is what tells the orders apart.
    """
    if out.dtype == torch.float32:
        _assert_close(out, ref)
        return
    assert not out.isnan().any(), f"{int(out.isnan().sum())} elements unwritten (NaN)"
    ulps = (out.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 1, f"{int(ulps.max())} ulps apart"
    assert int((ulps > 0).sum()) <= out.numel() // 100, f"{int((ulps > 0).sum())} of {out.numel()} differ"


@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GEMMA_SHAPES)
def test_gemma_rms_norm(shape: tuple[int, ...], dtype: torch.dtype, has_residual: bool) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    norm = _gemma_norm(shape[-1], dtype, gen)
    x = _gemma_input(shape, dtype, gen)
    if not has_residual:
        x_before = x.clone()
        out = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        assert rms_norm(x, norm.weight, norm.eps, out=out, gemma=True) is out
        _assert_gemma_close(out, norm.forward_torch(x_before))
        assert torch.equal(x, x_before), "the input must be left unchanged"
        return
    residual = _gemma_input(shape, dtype, gen)
    ref_out, ref_residual = norm.forward_torch(x, residual)
    out, new_residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps, gemma=True)
    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    assert torch.equal(new_residual, ref_residual)  # one rounding of the same two numbers
    _assert_gemma_close(out, ref_out)


def test_the_gemma_layer_runs_the_kernel_in_its_order() -> None:
    """GemmaRMSNorm's Triton path passes its order on: Llama's would scale by weight, not 1 + weight."""
    gen = torch.Generator().manual_seed(0)
    norm = _gemma_norm(256, torch.float32, gen)
    x, residual = _randn(5, 256, dtype=torch.float32, gen=gen), _randn(5, 256, dtype=torch.float32, gen=gen)
    _assert_close(norm.forward_triton(x), norm.forward_torch(x))
    ref_out, ref_residual = norm.forward_torch(x, residual)
    out, new_residual = norm.forward_triton(x, residual)
    _assert_close(out, ref_out)
    assert torch.equal(new_residual, ref_residual)


# (head_size, num_heads, num_kv_heads): GQA, MQA, a head count that is no power of two.
ROTARY_SHAPES = [(64, 8, 2), (80, 8, 2), (96, 12, 4), (128, 8, 1), (256, 4, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("head_size, num_heads, num_kv_heads", ROTARY_SHAPES)
def test_rotary_in_place_on_qkv_views(
    head_size: int, num_heads: int, num_kv_heads: int, num_tokens: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(head_size * num_tokens)
    max_position = 4096
    rope = RotaryEmbedding(head_size, max_position, {"rope_type": "default", "rope_theta": 10000.0}, dtype)
    rope = rope.to(DEVICE)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, gen=gen)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    v_before = v.clone()
    # Out of order, repeated, and a strided view: the kernel must index, not assume arange.
    positions = torch.randint(1, max_position, (2 * num_tokens,), generator=gen).to(DEVICE)[::2]
    ref_q, ref_k = rope.forward_torch(positions, q.clone(), k.clone())

    rotary_embedding(positions, q, k, rope.cos_sin_cache, head_size)

    assert torch.equal(v, v_before), "value columns of the fused buffer must be untouched"
    if dtype == torch.float32:
        _assert_close(q, ref_q)
        _assert_close(k, ref_k)
    else:
        # Same roundings in the same order: bit-identical under the interpreter (a compiled kernel may
        # fuse a product into its sum: tests/gpu compares within an ulp).
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


# (head_size, rotary_dim, num_heads, num_kv_heads): Qwen3-Next's quarter of 256 (16 q heads, 2 kv),
# Phi-3's three quarters of 64 (half 24: no power of two), 40 of 80 (half 20), 10 of 96.
PARTIAL_ROTARY_SHAPES = [(256, 64, 16, 2), (64, 48, 8, 2), (80, 40, 3, 1), (96, 10, 4, 4)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("head_size, rotary_dim, num_heads, num_kv_heads", PARTIAL_ROTARY_SHAPES)
def test_partial_rotary_in_place_on_qkv_views(
    head_size: int, rotary_dim: int, num_heads: int, num_kv_heads: int, num_tokens: int, dtype: torch.dtype
) -> None:
    """The first rotary_dim dimensions of each head rotated in place through the layer's Triton
    path, as its torch path rotates them; the rest of each head, and v, untouched."""
    gen = torch.Generator().manual_seed(head_size * num_tokens + rotary_dim)
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": rotary_dim / head_size}
    rope = RotaryEmbedding(head_size, 4096, params, dtype).to(DEVICE)
    assert rope.rotary_dim == rotary_dim and rope.is_partial
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, gen=gen)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    before = qkv.clone()
    positions = torch.randint(1, 4096, (2 * num_tokens,), generator=gen).to(DEVICE)[::2]
    ref_q, ref_k = rope.forward_torch(positions, q.clone(), k.clone())

    out_q, out_k = rope.forward_triton(positions, q, k)

    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    q_before, k_before, v_before = before.split([q_size, kv_size, kv_size], dim=-1)
    assert torch.equal(v, v_before)
    for out, ref, original in ((q, ref_q, q_before), (k, ref_k, k_before)):
        passed = (x.reshape(num_tokens, -1, head_size)[..., rotary_dim:] for x in (out, original))
        assert torch.equal(*passed)
        if dtype == torch.float32:
            _assert_close(out, ref)
        else:  # the same roundings in the same order (see test_rotary_in_place_on_qkv_views)
            assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size, num_heads, num_kv_heads", ROTARY_SHAPES[:3] + ROTARY_SHAPES[4:])
def test_rotary_fused_into_the_cache_write(
    head_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    """Query rotated in place and key rotated into the cache, in one kernel: what the rotary layer's
    torch path and a plain cache write give. A token with slot -1 (CUDA-graph padding, or a token
    another context-parallel rank stores) writes nothing, and its query is rotated all the same."""
    gen = torch.Generator().manual_seed(head_size)
    num_tokens, block_size, num_blocks = 9, 8, 6
    rope = RotaryEmbedding(head_size, 512, {"rope_type": "default", "rope_theta": 10000.0}, dtype).to(DEVICE)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, gen=gen)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    positions = torch.randint(0, 512, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    slots[3] = -1  # stored by no one here
    ref_q, ref_k = rope.forward_torch(positions, q.clone(), k.clone())
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    ref_caches = [torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]
    # The torch backend's layout is [blocks, block_size, heads, head]: write there, then transpose.
    torch_caches = [c.transpose(1, 2).contiguous() for c in ref_caches]
    kv_shape = (num_tokens, num_kv_heads, head_size)
    write_to_paged_cache(ref_k.view(kv_shape), v.view(kv_shape), *torch_caches, slots)
    ref_caches = [c.transpose(1, 2) for c in torch_caches]
    caches = [torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]

    table, index = rope.cos_sin_rows(positions)
    query = q.view(num_tokens, num_heads, head_size)
    reshape_and_cache(k.view(kv_shape), v.view(kv_shape), *caches, slots, rotary=(query, table, index))

    written = ~ref_caches[0].isnan()
    for cache, ref in zip(caches, ref_caches):
        assert torch.equal(cache.isnan(), ref.isnan()), "slots written differ"
    if dtype == torch.float32:
        _assert_close(q, ref_q)
        for cache, ref in zip(caches, ref_caches):
            _assert_close(cache[written], ref[written])
    else:  # the same roundings in the same order (see test_rotary_in_place_on_qkv_views)
        assert torch.equal(q, ref_q)
        assert all(torch.equal(c[written], r[written]) for c, r in zip(caches, ref_caches))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("d", HIDDEN_SIZES)
def test_silu_and_mul(d: int, num_tokens: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(d + num_tokens)
    # Rows strided by more than 2 * d: the kernel must follow the row stride.
    x = _randn(num_tokens, 2 * d + 8, dtype=dtype, gen=gen)[:, : 2 * d]
    out = torch.full((num_tokens, d), float("nan"), dtype=dtype, device=DEVICE)
    assert silu_and_mul(x, out=out) is out
    _assert_close(out, SiluAndMul().forward_torch(x))


# (num_heads, head_size): Qwen3-Next's 16 heads of 256, a head count and a head size that are no
# powers of two.
GATE_SHAPES = [(16, 256), (3, 80), (5, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("num_heads, head_size", GATE_SHAPES)
def test_sigmoid_gate_reads_strided_views(
    num_heads: int, head_size: int, num_tokens: int, dtype: torch.dtype
) -> None:
    """Gated attention's output gate against the layer's torch path: the gate a strided view of
    the q projection's output ([q | gate] per head, with k and v past it), the attention output a
    view of a wider buffer too."""
    gen = torch.Generator().manual_seed(num_heads * head_size + num_tokens)
    q_gate = _randn(num_tokens, num_heads * 2 * head_size + 64, dtype=dtype, gen=gen)
    gate = q_gate[:, : num_heads * 2 * head_size].view(num_tokens, num_heads, 2 * head_size)[..., head_size:]
    wide = _randn(num_tokens, num_heads * head_size + 8, dtype=dtype, gen=gen)
    x = wide[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    expected = SigmoidGate().forward_torch(x, gate)

    out = sigmoid_gate(x, gate)

    assert out.shape == (num_tokens, num_heads * head_size) and out.is_contiguous()
    if dtype == torch.float32:
        _assert_close(out, expected)
    else:
        # The sigmoid rounded to the dtype, then the product, as the torch path rounds: one ulp
        # where the exponentials' last float32 bits round the sigmoid the other way (a subnormal's
        # ulp is eps * tiny).
        assert not out.isnan().any()
        finfo = torch.finfo(dtype)
        torch.testing.assert_close(out, expected, atol=finfo.eps * finfo.tiny, rtol=finfo.eps)


def test_empty_batches_launch_nothing() -> None:
    weight = torch.ones(64, device=DEVICE)
    empty = torch.empty(0, 64, device=DEVICE)
    assert rms_norm(empty, weight, 1e-6).shape == (0, 64)
    assert fused_add_rms_norm(empty, empty.clone(), weight, 1e-6)[0].shape == (0, 64)
    assert silu_and_mul(empty).shape == (0, 32)
    cache = torch.ones(8, 64, device=DEVICE)
    rotary_embedding(torch.empty(0, dtype=torch.int64, device=DEVICE), empty, empty, cache, 64)


def test_layers_do_not_import_triton() -> None:
    """The layers import their kernels lazily: machines without triton (the CPU path) never need it."""
    code = (
        "import sys\n"
        "import pagedllm.layers.activation, pagedllm.layers.layernorm, pagedllm.layers.rotary_embedding\n"
        "assert 'triton' not in sys.modules, 'a layer imported triton at import time'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
