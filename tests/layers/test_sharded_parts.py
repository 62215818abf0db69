"""load_sharded_parts (layers/linear.py): a hybrid's fused projection ([q | k | v], Mamba-2's
[z | x | B | C | dt]) split part by part across tensor-parallel ranks, and a quantized weight's
scales through the same loader: per-row, per-block (FP8 block scales), per-tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.layers.linear import load_sharded_parts
from pagedllm.layers.quantization.params import PER_PROJECTION, ParamLayout, set_layout

PARTS = (8, 8, 16)  # one rank's rows of q, k, v


def _expected(checkpoint: torch.Tensor, rank: int, tp_size: int, parts: tuple[int, ...]) -> torch.Tensor:
    """Each part's rank-th slice, end to end (the split written out by hand)."""
    pieces, start = [], 0
    for size in parts:
        pieces.append(checkpoint[start + rank * size : start + (rank + 1) * size])
        start += size * tp_size
    return torch.cat(pieces)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_each_rank_takes_its_slice_of_every_part(tp_size: int) -> None:
    checkpoint = torch.randn(sum(PARTS) * tp_size, 5)
    for rank in range(tp_size):
        param = nn.Parameter(torch.empty(sum(PARTS), 5), requires_grad=False)
        load_sharded_parts(param, checkpoint, PARTS, rank, tp_size)
        assert torch.equal(param.data, _expected(checkpoint, rank, tp_size, PARTS))


def test_block_scales_split_by_whole_blocks() -> None:
    """FP8 block scales of 4 rows each: a part of 8 rows on a rank holds 2 of them."""
    checkpoint = torch.randn(sum(PARTS) * 2 // 4, 3)
    for rank in range(2):
        param = set_layout(
            nn.Parameter(torch.empty(sum(PARTS) // 4, 3), requires_grad=False), ParamLayout(0, 1, 4, 4)
        )
        load_sharded_parts(param, checkpoint, PARTS, rank, 2)
        assert torch.equal(param.data, _expected(checkpoint, rank, 2, tuple(size // 4 for size in PARTS)))


def test_a_per_tensor_scale_loads_whole_and_partial_blocks_are_refused() -> None:
    scale = set_layout(nn.Parameter(torch.empty(1), requires_grad=False), PER_PROJECTION)
    load_sharded_parts(scale, torch.tensor(0.25), PARTS, 1, 2)
    assert scale.item() == 0.25
    blocks = set_layout(nn.Parameter(torch.empty(3, 3), requires_grad=False), ParamLayout(0, 1, 16, 16))
    with pytest.raises(ValueError, match="not a whole number of 16-feature entries"):
        load_sharded_parts(blocks, torch.randn(6, 3), PARTS, 0, 2)
