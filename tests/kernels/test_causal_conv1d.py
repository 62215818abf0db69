"""The conv1d kernels (kernels/triton/causal_conv1d.py) against the torch references
(layers/linear_attention/conv1d.py), on the GPU or in Triton's interpreter: windows read and
written in place at scattered rows and the scratch row (-1), fresh sequences reading zeros whatever
their row holds (NaN here), rows of other slots untouched, a column map into a wider input with a
row stride past its width, channel counts that are not powers of two, and, for the varlen prefill,
ragged chunks around the kernel size and the token tile, one to three output splits."""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedllm.kernels.triton.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from pagedllm.layers.linear_attention import conv1d
from pagedllm.layers.linear_attention.mixer import column_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
Map = bool | str  # no map, a gathered map, or "runs"
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _inputs(
    num_tokens: int, channels: int, kernel: int, bias: bool, column_map: Map, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(x, cols, weight, bias, the conv's input [num_tokens, channels]). With a column map, x is
    wider than the channels, a view with a row stride wider still, and channel c reads column
    cols[c]: a permutation of some of its columns ("gather"), or of some of its aligned blocks of
    128 columns ("runs", Qwen3-Next's layout: whole blocks load as vectors)."""
    gen = torch.Generator().manual_seed(seed)
    width = channels + (256 if column_map == "runs" else 37) if column_map else channels
    base = torch.randn(num_tokens, width + 16 if column_map else width, generator=gen).to(dtype).to(DEVICE)
    x = base[:, :width]
    cols = None
    if column_map == "runs":
        blocks = torch.randperm(width // 128, generator=gen)[: channels // 128]
        cols = (blocks[:, None] * 128 + torch.arange(128)).flatten().to(torch.int32).to(DEVICE)
    elif column_map:
        cols = torch.randperm(width, generator=gen)[:channels].to(torch.int32).to(DEVICE)
    weight = torch.randn(channels, kernel, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(channels, generator=gen).to(dtype).to(DEVICE) if bias else None
    return x, cols, weight, b, x if cols is None else x[:, cols.long()]


def _state(
    num_rows: int, channels: int, kernel: int, fresh_slots: list[int], dtype: torch.dtype
) -> torch.Tensor:
    state = torch.randn(num_rows, channels, kernel - 1, generator=torch.Generator().manual_seed(1)).to(dtype)
    state[fresh_slots] = float("nan")  # the fresh sequences' rows: must not be read
    return state.to(DEVICE)


def _check_rows(
    state: torch.Tensor, before: torch.Tensor, slots: list[int], expected: list[torch.Tensor]
) -> None:
    """The sequences' rows hold their expected windows; every other row is as it was."""
    rows = [slot % state.shape[0] for slot in slots]
    for row, window in zip(rows, expected):
        torch.testing.assert_close(state[row], window.to(state.dtype), atol=0, rtol=0)
    others = [row for row in range(state.shape[0]) if row not in rows]
    torch.testing.assert_close(state[others], before[others], atol=0, rtol=0, equal_nan=True)


DECODE_SLOTS = [3, 0, -1, 5]  # scattered rows, and the scratch row
DECODE_HAS_STATE = [True, False, True, True]  # the second sequence is at its first token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("channels", "kernel", "bias", "column_map"),
    [
        (48, 4, True, False),
        (300, 4, False, False),
        (20, 2, True, False),
        (300, 4, True, True),
        (44, 3, False, True),
        (384, 4, True, "runs"),
    ],
)
def test_conv1d_update_matches_reference(
    dtype: torch.dtype, channels: int, kernel: int, bias: bool, column_map: Map
) -> None:
    x, cols, weight, b, conv_input = _inputs(len(DECODE_SLOTS), channels, kernel, bias, column_map, dtype, 0)
    state = _state(7, channels, kernel, [0], dtype)
    before = state.clone()
    slots = torch.tensor(DECODE_SLOTS, device=DEVICE)
    has_state = torch.tensor(DECODE_HAS_STATE, device=DEVICE)
    expected, expected_rows = conv1d.causal_conv1d_update(conv_input, weight, b, state[slots], has_state)
    out = causal_conv1d_update(
        x, weight, b, state, slots, has_state, cols=cols, cols_run=_run(cols, column_map)
    )
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    _check_rows(state, before, DECODE_SLOTS, list(expected_rows))


def _varlen_case(
    lengths: list[int],
    has_state: list[bool],
    channels: int,
    kernel: int,
    bias: bool,
    column_map: Map,
    splits: tuple[int, ...],
    dtype: torch.dtype,
) -> None:
    num_seqs = len(lengths)
    num_rows = num_seqs + 3
    # Scattered distinct rows, the last sequence on the scratch row.
    slots = torch.randperm(num_rows - 1, generator=torch.Generator().manual_seed(2))[:num_seqs].tolist()
    slots[-1] = -1
    fresh = [slot for slot, keep in zip(slots, has_state) if not keep]
    x, cols, weight, b, conv_input = _inputs(sum(lengths), channels, kernel, bias, column_map, dtype, 3)
    state = _state(num_rows, channels, kernel, fresh, dtype)
    before = state.clone()

    starts = [0, *itertools.accumulate(lengths)]
    outputs, windows = [], []
    for start, end, slot, keep in zip(starts, starts[1:], slots, has_state):
        start_window = state[slot] if keep else None
        out, window = conv1d.causal_conv1d_prefill(conv_input[start:end], weight, b, start_window)
        outputs.append(out)
        windows.append(window)
    expected = torch.cat(outputs).split(splits, dim=1)

    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    outs = causal_conv1d_varlen(
        x,
        weight,
        b,
        state,
        torch.tensor(slots, device=DEVICE),
        torch.tensor(has_state, device=DEVICE),
        query_start_loc,
        max(lengths),
        splits,
        cols=cols,
        cols_run=_run(cols, column_map),
    )
    assert [out.shape for out in outs] == [(sum(lengths), width) for width in splits]
    assert all(out.is_contiguous() and out.dtype == dtype for out in outs)
    for out, reference in zip(outs, expected):
        torch.testing.assert_close(out, reference, **TOLERANCES[dtype])
    _check_rows(state, before, slots, windows)


# (kernel, channels, bias, column map, splits): one output; two, the first wider than a channel
# block; three (q, k, v) through a column map, at each kernel size.
VARLEN_CASES = [
    (4, 40, True, False, (40,)),
    (4, 200, False, False, (136, 64)),
    *((kernel, 100, True, True, (24, 24, 52)) for kernel in (2, 3, 4)),
    (4, 384, False, "runs", (128, 128, 128)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kernel", "channels", "bias", "column_map", "splits"), VARLEN_CASES)
def test_conv1d_varlen_matches_reference(
    dtype: torch.dtype, kernel: int, channels: int, bias: bool, column_map: Map, splits: tuple[int, ...]
) -> None:
    # Chunks of 1, 2, K - 1 and K tokens, each continuing and starting its sequence, and chunks
    # longer than the token tile (64 here), at offsets that are not multiples of it.
    lengths = [1, 1, 2, 2, kernel - 1, kernel - 1, kernel, kernel, 70, 5, 67]
    has_state = [True, False] * 4 + [True, False, False]
    _varlen_case(lengths, has_state, channels, kernel, bias, column_map, splits, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv1d_varlen_short_chunks(dtype: torch.dtype) -> None:
    """A step of short chunks only (a short token tile), and a single sequence."""
    _varlen_case([1, 3, 2, 1], [False, True, False, True], 100, 4, True, True, (24, 24, 52), dtype)
    _varlen_case([9], [True], 40, 4, False, False, (40,), dtype)


def _run(cols: torch.Tensor | None, column_map: Map) -> int:
    """The map's run, as the layer computes it: 128 for "runs", which the kernels then read as
    whole blocks; small for a gathered map."""
    if cols is None:
        return 1
    run = column_run(cols.cpu())
    assert (run == 128) == (column_map == "runs"), run
    return run
