"""One attention-backend signature: a layer's rotary embedding is given to its backend, which
rotates query and key itself, or in its cache write where its kernel can (Triton's); the model
passes positions to every backend alike. And the GPU backends are composed of pieces.

Runs on the CPU under TRITON_INTERPRET=1 (conftest.py), else on CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the triton attention backend needs the triton package")

from test_triton_attention import DEVICE, make_batch

from pagedllm.attention.backends import get_attn_backend
from pagedllm.attention.backends.cuda_backend import CudaAttentionBackend
from pagedllm.attention.backends.paged import PagedAttentionBackend
from pagedllm.attention.backends.triton_backend import TritonAttentionBackend
from pagedllm.layers.rotary_embedding import RotaryEmbedding

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, MAX_POSITION = 8, 2, 64, 16, 256


@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param("cpu", marks=pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU backend")),
        "triton",
    ],
)
def test_a_backend_given_the_rotary_embedding_computes_what_rotating_first_did(backend: str) -> None:
    # Three decodes, two prefill chunks (one behind a cached prefix), CUDA-graph padding.
    shape = (NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32)
    batch = make_batch(3, [5, 40, 17, 0, 24], [1, 1, 1, 20, 9], *shape, num_padding_tokens=3)
    num_tokens, num_real = batch.query.shape[0], int(batch.md.query_start_loc_cpu[-1])
    rope = RotaryEmbedding(
        HEAD_SIZE, MAX_POSITION, {"rope_type": "default", "rope_theta": 1e4}, torch.float32
    )
    rope = rope.to(DEVICE)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=torch.Generator().manual_seed(1))
    positions = positions.to(DEVICE)
    backend_cls = get_attn_backend(backend, DEVICE)

    def caches() -> tuple[torch.Tensor, torch.Tensor]:
        paged = (batch.key_cache.clone(), batch.value_cache.clone())
        return paged if issubclass(backend_cls, PagedAttentionBackend) else batch.torch_caches()

    def qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Views of one fused QKV projection output, as models pass them.
        fused = torch.cat([batch.query.flatten(1), batch.key.flatten(1), batch.value.flatten(1)], dim=1)
        q, k, v = fused.split([NUM_HEADS * HEAD_SIZE, *[NUM_KV_HEADS * HEAD_SIZE] * 2], dim=1)
        return q.view(batch.query.shape), k.view(batch.key.shape), v.view(batch.value.shape)

    # What the model did before: rotate, then call a backend that knows nothing of positions.
    query, key, value = qkv()
    rotated_q, rotated_k = rope.forward_torch(positions, query.flatten(1), key.flatten(1))
    plain = backend_cls(NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, NUM_KV_HEADS)
    expected_caches = caches()
    expected = plain.forward(
        rotated_q.view(query.shape), rotated_k.view(key.shape), value, expected_caches, batch.md
    )

    seam = backend_cls(NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, NUM_KV_HEADS, rotary=rope)
    got_caches = caches()
    got = seam.forward(*qkv(), got_caches, batch.md, positions=positions)

    # float32: the fused kernel's products may round apart from torch's by an ulp.
    torch.testing.assert_close(got[:num_real], expected[:num_real], atol=1e-5, rtol=1e-5)
    for cache, reference in zip(got_caches, expected_caches):
        torch.testing.assert_close(cache, reference, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_the_gpu_backends_are_composed_of_pieces_not_derived_from_each_other() -> None:
    assert not issubclass(CudaAttentionBackend, TritonAttentionBackend)
    assert not issubclass(TritonAttentionBackend, CudaAttentionBackend)
    # One step, four pieces each: the prefill kernel reads both layouts, so both take it.
    assert CudaAttentionBackend.forward is TritonAttentionBackend.forward is PagedAttentionBackend.forward
    assert CudaAttentionBackend.prefill is TritonAttentionBackend.prefill
    for piece in ("get_kv_cache_shape", "write_cache", "decode"):
        assert getattr(CudaAttentionBackend, piece) is not getattr(TritonAttentionBackend, piece)
