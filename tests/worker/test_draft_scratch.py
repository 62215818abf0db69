"""The draft model's proposals write positions P .. P + k - 1 into private scratch blocks: enough
of them for every offset of P in its block, counted by brute force."""

from __future__ import annotations

import pytest

from pagedllm.worker.draft_model import scratch_blocks_per_request


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 16, 17])
def test_scratch_blocks_cover_the_widest_span_of_k_positions(block_size, k):
    spans = [len({(p + j) // block_size for j in range(k)}) for p in range(block_size)]
    assert scratch_blocks_per_request(block_size, k) == max(spans)
