"""The prefill's state-row gather and scatter (kernels/triton/state_rows.py) against the torch
expressions they replace, on the GPU or in Triton's interpreter: scattered slots and the scratch
row (-1), fresh sequences whose rows hold NaN (read as zeros, never read), rows of any size (one
shorter than a block, one ending in a partial block), rows strided apart (views of wider
tensors), the cache in each of its dtypes and fla's float32 final states."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.kernels.triton.state_rows import gather_state_rows, scatter_state_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS = [3, 0, -1, 5, 2]  # scattered rows, and the scratch row
HAS_STATE = [True, False, True, True, False]  # the second and last sequences start here
NUM_ROWS = 7
# [heads, d_v, d_k] per row: a Gated DeltaNet head shape, odd sizes (105 elements, under one
# block), 10,240 elements (two blocks and a half).
ROW_SHAPES = [(2, 16, 16), (3, 5, 7), (4, 40, 64)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cache(shape: tuple[int, ...], dtype: torch.dtype, strided: bool, gen: torch.Generator) -> torch.Tensor:
    """[NUM_ROWS, *shape] rows, the fresh sequences' holding NaN; with ``strided``, a view of every
    other row-sized run of a wider tensor (rows twice their size apart)."""
    wide = torch.randn(NUM_ROWS, 2, *shape, generator=gen).to(dtype).to(DEVICE)
    cache = wide[:, 1] if strided else wide[:, 1].contiguous()
    for slot, keep in zip(SLOTS, HAS_STATE):
        if not keep:
            cache[slot] = float("nan")
    return cache


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_gather_reads_each_row_or_zeros(shape, dtype, strided) -> None:
    gen = torch.Generator().manual_seed(0)
    cache = _cache(shape, dtype, strided, gen)
    slots = torch.tensor(SLOTS, device=DEVICE)
    has_state = torch.tensor(HAS_STATE, device=DEVICE)
    before = cache.clone()
    expected = torch.where(has_state.view(-1, *[1] * len(shape)), cache[slots], 0)

    rows = gather_state_rows(cache, slots, has_state)

    assert rows.dtype == dtype and rows.is_contiguous() and rows.shape == (len(SLOTS), *shape)
    assert not rows.isnan().any()
    assert torch.equal(rows, expected)  # a copy: bit for bit
    assert torch.equal(cache.isnan(), before.isnan()) and torch.equal(cache.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_scatter_rounds_each_row_into_its_slot(shape, dtype, strided) -> None:
    gen = torch.Generator().manual_seed(1)
    cache = _cache(shape, dtype, strided, gen)
    slots = torch.tensor(SLOTS, device=DEVICE, dtype=torch.int32)
    # fla's final states: float32, here as a strided view too when the cache is one.
    wide = (10 * torch.randn(len(SLOTS), 3, *shape, generator=gen)).to(DEVICE)
    final = wide[:, 2] if strided else wide[:, 2].contiguous()
    expected = cache.clone()
    expected[slots.long()] = final.to(dtype)

    scatter_state_rows(cache, slots, final)

    others = [r for r in range(NUM_ROWS) if r not in {s % NUM_ROWS for s in SLOTS}]
    assert torch.equal(cache[others], expected[others])  # untouched
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        # Triton's interpreter truncates float32 to bfloat16 where a GPU (and torch) round to
        # nearest: within one ulp.
        torch.testing.assert_close(cache, expected, atol=0, rtol=2**-7)
    else:
        assert torch.equal(cache, expected)


def test_no_sequences_launch_nothing() -> None:
    cache = torch.zeros(NUM_ROWS, 2, 4, 4, device=DEVICE)
    none = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert gather_state_rows(cache, none, none.bool()).shape == (0, 2, 4, 4)
    scatter_state_rows(cache, none, torch.empty(0, 2, 4, 4, device=DEVICE))
    assert not cache.any()
