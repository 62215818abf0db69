"""Context parallelism's cache write rotates every query: the fused rotating write of the Triton
backend skips the tokens it does not store (slot -1), which with context parallelism are the
tokens another rank stores, and whose queries this rank still attends with."""

from __future__ import annotations

import torch

from pagedllm.attention.backends.triton_backend import TritonAttentionBackend
from pagedllm.layers.rotary_embedding import RotaryEmbedding

HEAD_SIZE = 64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on the CPU


def test_every_query_is_rotated_whichever_rank_stores_its_token():
    rope = RotaryEmbedding(HEAD_SIZE, 512, {"rope_type": "default", "rope_theta": 10000.0}, torch.float32)
    rope = rope.to(DEVICE)
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(4, h, HEAD_SIZE, generator=gen).to(DEVICE) for h in (2, 1, 1))
    positions = torch.arange(4, device=DEVICE) + 5
    expected, _ = rope(positions, query.clone().flatten(1), key.clone().flatten(1))
    # Rank 1 of 2 stores positions 5 and 7 (slots 3 and 4); rank 0 stores 6 and 8.
    slot_mapping = torch.tensor([3, -1, 4, -1], device=DEVICE)
    backend = TritonAttentionBackend(
        2, HEAD_SIZE, HEAD_SIZE**-0.5, 1, rotary=rope, cp_rank=1, cp_world_size=2
    )
    caches = tuple(torch.zeros(8, 1, 16, HEAD_SIZE, device=DEVICE) for _ in range(2))
    rotated = backend.write_cache(query.clone(), key.clone(), value, caches, slot_mapping, positions)
    torch.testing.assert_close(rotated.flatten(1), expected)
    # The stored keys are rotated, once.
    _, expected_key = rope(positions, query.clone().flatten(1), key.clone().flatten(1))
    torch.testing.assert_close(caches[0][0, 0, 3], expected_key[0])
    torch.testing.assert_close(caches[0][0, 0, 4], expected_key[2])
