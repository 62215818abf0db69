"""The Triton SGMV shrink/expand (kernels/triton/lora_sgmv.py) against a torch reference that
multiplies each adapter's own (unpadded) A and B with its tokens as a dense matmul; and the
segments a step is grouped into. On the CPU the kernels run under TRITON_INTERPRET=1.

Shapes cover what the grouping can get wrong: ranks 4, 8 and 16 in slots sized for 16, one to
three slices (an unfused projection, gate/up, q/k/v with a slice boundary inside an output
tile), tokens without adapter, a segment of one token, one longer than BLOCK_M, an empty
segment, and a step with no adapter at all, at both tile heights; and the plan's arrays, each
from a 16-byte boundary (Triton specialises on pointer alignment). float32 here (bf16 on CUDA).
What SGMV launches (compile keys, decode's fixed grids, the choice per step):
test_lora_sgmv_launches.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.kernels.triton.lora_sgmv import lora_sgmv_shrink_expand, plan_segments
from pagedllm.lora.punica import NO_SLOT

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_RANK, IN_FEATURES = 16, 32


def random_adapters(ranks, slice_sizes, generator, in_features=IN_FEATURES):
    """Per slot, per slice: A [r, in] and B [out_slice, r]."""
    return [
        [
            (torch.randn(r, in_features, generator=generator), torch.randn(size, r, generator=generator))
            for size in slice_sizes
        ]
        for r in ranks
    ]


def stack(adapters, slice_sizes, dtype):
    """The LoRA layers' slot layout: A [n*S*R, in], B [out, n*S*R] (lora/layers.py)."""
    num_slots, n, in_features = len(adapters), len(slice_sizes), adapters[0][0][0].shape[1]
    lora_a = torch.zeros(n * num_slots * MAX_RANK, in_features)
    lora_b = torch.zeros(sum(slice_sizes), n * num_slots * MAX_RANK)
    for slot, slices in enumerate(adapters):
        for i, (a, b) in enumerate(slices):
            col, row = (i * num_slots + slot) * MAX_RANK, sum(slice_sizes[:i])
            lora_a[col : col + a.shape[0]] = a
            lora_b[row : row + b.shape[0], col : col + a.shape[0]] = b
    return lora_a.to(DEVICE, dtype), lora_b.to(DEVICE, dtype)


def dense_reference(y, x, adapters, slice_sizes, token_slots):
    """y + each adapter's (x A^T) B^T over its own tokens, slice by slice, in float32."""
    expected = y.float().cpu().clone()
    x = x.float().cpu()
    for slot, slices in enumerate(adapters):
        rows = torch.from_numpy(np.flatnonzero(token_slots == slot))
        for i, (a, b) in enumerate(slices):
            start = sum(slice_sizes[:i])
            expected[rows, start : start + b.shape[0]] += (x[rows] @ a.T) @ b.T
    return expected


def slice_starts(slice_sizes):
    """The first output row of slices 1 and 2 (the output size past the last)."""
    starts = [sum(slice_sizes[: i + 1]) for i in range(len(slice_sizes) - 1)]
    return tuple(starts + [sum(slice_sizes)] * (2 - len(starts)))


def run_sgmv(
    slice_sizes, ranks, token_slots, dtype, seed=0, block_m=None, in_features=IN_FEATURES, plan=None
):
    """(SGMV's y, y before, the dense reference) for random adapters of ``ranks``; ``plan``: the
    segments to launch over (default: ``plan_segments``'s of ``token_slots``)."""
    generator = torch.Generator().manual_seed(seed)
    adapters = random_adapters(ranks, slice_sizes, generator, in_features)
    lora_a, lora_b = stack(adapters, slice_sizes, dtype)
    x = torch.randn(len(token_slots), in_features, generator=generator).to(DEVICE, dtype)
    y = torch.randn(len(token_slots), sum(slice_sizes), generator=generator).to(DEVICE, dtype)
    expected = dense_reference(y, x, adapters, slice_sizes, token_slots)
    got = y.clone()
    if plan is None:
        plan = plan_segments(token_slots, len(ranks), DEVICE, block_m)
    lora_sgmv_shrink_expand(got, x, lora_a, lora_b, plan, len(ranks), MAX_RANK, slice_starts(slice_sizes))
    return got, y, expected


def mixed_slots(rng):
    """70 tokens of slot 0 (two BLOCK_M tiles), 1 of slot 1, none of slot 2, 5 of slot 3, 6 without
    adapter, shuffled."""
    slots = np.array([0] * 70 + [1] + [3] * 5 + [NO_SLOT] * 6)
    return rng.permutation(slots)


@pytest.mark.parametrize("block_m", [None, 64], ids=["auto", "tiles-of-64"])
@pytest.mark.parametrize(
    ("slice_sizes", "dtype"),
    [
        ((24,), torch.float32),
        ((40, 24), torch.float32),
        ((80, 24, 24), torch.float32),  # three slices in one 128-wide output tile
        ((136, 24, 24), torch.float32),  # both boundaries inside the second output tile
        # The interpreter's bf16 tl.dot is wrong (Triton 3.9): bf16 runs on CUDA only, here and in
        # tests/gpu/test_lora_gpu.py at model sizes.
        *([((80, 24, 24), torch.bfloat16)] if torch.cuda.is_available() else []),
    ],
)
def test_sgmv_equals_each_adapters_dense_product(slice_sizes, dtype, block_m):
    token_slots = mixed_slots(np.random.default_rng(len(slice_sizes)))
    got, y, expected = run_sgmv(slice_sizes, [16, 4, 8, 8], token_slots, dtype, block_m=block_m)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float().cpu(), expected, rtol=tolerance, atol=tolerance * 10)
    untouched = torch.from_numpy(token_slots == NO_SLOT)
    assert torch.equal(got.cpu()[untouched], y.cpu()[untouched])


@pytest.mark.parametrize(
    "token_slots",
    [np.array([2]), np.array([NO_SLOT, NO_SLOT, NO_SLOT]), np.array([1, NO_SLOT, 1, 0, 2, 2, 0])],
    ids=["one-token", "no-adapter", "short-segments"],
)
def test_sgmv_short_and_empty_steps(token_slots):
    got, _, expected = run_sgmv((16, 8, 8), [4, 8, 16], token_slots, torch.float32, seed=3)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-3)


def test_plan_segments_groups_tokens_by_slot():
    token_slots = np.array([2, NO_SLOT, 0, 2, 0, NO_SLOT, 2])
    plan = plan_segments(token_slots, num_slots=4, device=torch.device("cpu"))
    # Tokens without adapter first (outside every segment), then slot 0's, 2's; slots 1, 3 empty.
    assert plan.num_tokens == 7 and plan.sorted_tokens[:7].tolist() == [1, 5, 2, 4, 0, 3, 6]
    assert plan.seg_start.tolist() == [2, 4, 4, 7]
    assert plan.seg_len.tolist() == [2, 0, 3, 0]
    # Few tokens: tiles of 16, one per non-empty segment; slot -1 in every entry past them.
    assert plan.block_m == 16 and plan.num_tiles == 2 and plan.grid_tiles(7) == 2
    assert plan.tile_slot.tolist() == [0, 2] + [-1] * (len(plan.tile_slot) - 2)
    assert plan.tile_m0[:2].tolist() == [0, 0]


def test_plan_segments_cuts_long_segments_into_tiles():
    # 40 tokens of slot 1, 16 of slot 0, 3 of slot 3: tiles of 16 rows.
    token_slots = np.array([1] * 40 + [0] * 16 + [3] * 3)
    plan = plan_segments(token_slots, num_slots=4, device=torch.device("cpu"))
    assert plan.tile_slot[: plan.num_tiles].tolist() == [0, 1, 1, 1, 3]
    assert plan.tile_m0[: plan.num_tiles].tolist() == [0, 0, 16, 32, 0]
    # Enough tokens for 256 tiles of 64: the largest tile.
    many = plan_segments(np.arange(64 * 256) % 8, num_slots=8, device=torch.device("cpu"))
    assert many.block_m == 64 and many.num_tiles == 256
    assert many.tile_m0.tolist()[:33] == [64 * i for i in range(32)] + [0]


@pytest.mark.parametrize("num_tokens", [1, 3, 5, 70, 130, 1001])
def test_plan_arrays_start_on_16_byte_boundaries(num_tokens):
    """Triton specialises on each pointer's 16-byte alignment: a plan array at an offset that
    varied with the token count would compile new kernel variants mid-run."""
    rng = np.random.default_rng(num_tokens)
    token_slots = rng.integers(NO_SLOT, 3, num_tokens)
    plan = plan_segments(token_slots, num_slots=3, device=torch.device("cpu"))
    arrays = (plan.sorted_tokens, plan.seg_start, plan.seg_len, plan.tile_slot, plan.tile_m0)
    assert all(a.data_ptr() % 16 == 0 for a in arrays)
    assert plan.sorted_tokens[:num_tokens].tolist() == np.argsort(token_slots, kind="stable").tolist()
    assert plan.seg_len.tolist() == [int((token_slots == s).sum()) for s in range(3)]
