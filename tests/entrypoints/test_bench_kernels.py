"""``pagedllm bench kernels`` without a GPU: arguments, context lengths, launch lists, the SDPA bar's
cache packing (against a naive attention over the paged cache), the table and the plot.
tests/gpu/test_bench_kernels_gpu.py runs the benchmark itself."""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.entrypoints.bench.kernels import (
    ContextRange,
    add_cli_args,
    best_rows,
    format_table,
    main,
    write_plot,
)
from pagedllm.kernels.bench import DECODE_IMPLS, ContiguousSdpa, DecodeInputs, DecodeShape, bench_decode


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(argv)


def test_defaults_are_k1() -> None:
    args = _parse()
    assert [context.label for context in args.contexts] == ["512", "4096", "16384", "1-8192"]
    assert (args.batch_size, args.num_heads, args.num_kv_heads, args.head_size, args.block_size) == (
        64,
        32,
        8,
        128,
        16,
    )
    assert args.dtype == "bfloat16" and not args.sweep
    # One table compares the Triton kernel with vLLM's original CUDA V1 and V2.
    assert args.implementations == ["triton", "cuda-v1", "cuda-v2"]


def test_contexts_parse_as_lengths_or_ranges() -> None:
    args = _parse("--contexts", "4096", "1-8192", "--sweep", "--output-json", "out.json")
    assert args.contexts == [ContextRange(4096, 4096), ContextRange(1, 8192)]
    assert args.sweep and args.output_json == "out.json"


@pytest.mark.parametrize("text", ["0", "9-3", "abc", "1-", "-5"])
def test_bad_contexts_are_rejected(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--contexts", text)
    assert f"context {text!r}" in capsys.readouterr().err


def test_ragged_lengths_follow_the_workload_recipe() -> None:
    lengths = ContextRange(1, 8192).seq_lens(64, seed=0)
    rng = random.Random(0)
    assert lengths == tuple(rng.randint(1, 8192) for _ in range(64))
    assert len(set(lengths)) > 32 and all(1 <= n <= 8192 for n in lengths)
    assert ContextRange(4096, 4096).seq_lens(3, seed=0) == (4096, 4096, 4096)


def test_launches_start_with_the_engines_then_sweep_the_grid() -> None:
    triton_impl = DECODE_IMPLS["triton"]
    shape = DecodeShape((4096,) * 64, 32, 8, 128, 16, torch.bfloat16)
    (default,) = triton_impl.launches(shape, sweep=False)
    # The engine's launch table (off a GPU the partition rule has no SMs to count: the table's
    # 1024 stands; tests/attention/test_decode_partition.py covers the rule).
    assert default == {"partition_size": 1024, "block_n": 64, "num_warps": 4, "num_stages": 2}
    swept = triton_impl.launches(shape, sweep=True)
    assert swept[0] == default and len(swept) == 6 * 3 * 2 * 2
    assert len({tuple(launch.items()) for launch in swept}) == len(swept)


def test_flashinfer_is_timed_with_both_of_its_decodes() -> None:
    """The peer's bar is the faster of its CUDA-core and tensor-core decodes: both are entries,
    so that a run without --sweep times both."""
    shape = DecodeShape((4096,) * 64, 32, 8, 128, 16, torch.bfloat16)
    assert DECODE_IMPLS["flashinfer"].launches(shape, sweep=True) == [{"use_tensor_cores": 0}]
    assert DECODE_IMPLS["flashinfer-tc"].launches(shape, sweep=True) == [{"use_tensor_cores": 1}]
    assert DECODE_IMPLS["flashinfer"].package == DECODE_IMPLS["flashinfer-tc"].package == "flashinfer"


def test_bytes_moved_counts_kv_once_plus_query_and_output() -> None:
    shape = DecodeShape((4096, 100), 32, 8, 128, 16, torch.bfloat16)
    assert shape.bytes_moved == (2 * 4196 * 8 * 128 + 2 * 2 * 32 * 128) * 2


def test_windowed_bytes_count_only_the_window() -> None:
    shape = DecodeShape((4096, 100), 32, 8, 128, 16, torch.bfloat16, sliding_window=1024)
    assert shape.attended_lens == (1024, 100)
    assert shape.bytes_moved == (2 * 1124 * 8 * 128 + 2 * 2 * 32 * 128) * 2


def test_fp8_cache_bytes_count_one_byte_a_kv_element() -> None:
    shape = DecodeShape((4096, 100), 32, 8, 128, 16, torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    assert shape.bytes_moved == 2 * 4196 * 8 * 128 * 1 + 2 * 2 * 32 * 128 * 2


def test_an_fp8_cache_is_timed_only_where_a_kernel_reads_it() -> None:
    shape = DecodeShape((40,), 8, 2, 32, 16, torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    assert DECODE_IMPLS["triton"].supports_fp8_cache
    with pytest.raises(ValueError, match=r"kv_cache_dtype.*cuda-v1"):
        bench_decode(shape, {"cuda-v1": [{}]})
    assert _parse("--kv-cache-dtype", "fp8").kv_cache_dtype == "fp8"


def _naive_decode(inputs: DecodeInputs) -> torch.Tensor:
    """Each query head's softmax attention over its sequence's tokens (its last sliding_window
    ones with a window), gathered slot by slot."""
    shape = inputs.shape
    group = shape.num_heads // shape.num_kv_heads
    outs = []
    for i, seq_len in enumerate(shape.seq_lens):
        window = shape.sliding_window or seq_len
        positions = torch.arange(max(0, seq_len - window), seq_len)
        blocks = inputs.block_tables[i, positions // shape.block_size].long()
        # [seq_len, num_kv_heads, head_size] -> one KV head per query head.
        keys, values = (
            cache[blocks, :, positions % shape.block_size]
            .to(inputs.query.dtype)
            .repeat_interleave(group, dim=1)
            for cache in (inputs.key_cache, inputs.value_cache)
        )
        scores = torch.einsum("hd,thd->ht", inputs.query[i], keys) * inputs.scale
        outs.append(torch.einsum("ht,thd->hd", scores.softmax(-1), values))
    return torch.stack(outs)


@pytest.mark.parametrize(
    "seq_lens, window",
    [
        ((40, 40, 40), None),
        ((1, 37, 16, 70), None),
        ((40, 40, 40), 19),
        ((1, 37, 16, 70), 30),
        ((50, 60), 20),
    ],
    ids=["uniform", "ragged", "uniform-window", "ragged-window", "ragged-window-uniform"],
)
def test_contiguous_sdpa_computes_the_paged_attention(seq_lens: tuple[int, ...], window: int | None) -> None:
    shape = DecodeShape(
        seq_lens,
        num_heads=8,
        num_kv_heads=2,
        head_size=32,
        block_size=16,
        dtype=torch.float32,
        sliding_window=window,
    )
    inputs = DecodeInputs.random(shape, torch.device("cpu"), seed=0)
    sdpa = ContiguousSdpa(inputs)
    assert sdpa.ragged == (len(set(shape.attended_lens)) > 1)
    torch.testing.assert_close(sdpa.heads(sdpa()), _naive_decode(inputs), atol=1e-5, rtol=1e-5)


def test_the_bar_over_an_fp8_cache_attends_to_its_dequantized_values() -> None:
    """An FP8 cache holds the random values rounded to float8_e4m3fn (unit scales): the SDPA bar
    reads them dequantized, the same attention the naive loop computes from the FP8 bytes."""
    shape = DecodeShape((1, 37, 70), 8, 2, 32, 16, torch.float32, kv_dtype=torch.float8_e4m3fn)
    inputs = DecodeInputs.random(shape, torch.device("cpu"), seed=0)
    assert inputs.key_cache.dtype == torch.float8_e4m3fn and float(inputs.k_scale) == 1.0
    sdpa = ContiguousSdpa(inputs)
    torch.testing.assert_close(sdpa.heads(sdpa()), _naive_decode(inputs), atol=1e-5, rtol=1e-5)


def _row(context: str, ms: float, launch: dict[str, int], default: bool = True) -> dict[str, Any]:
    return {
        "context": context,
        "implementation": "triton",
        "launch": launch,
        "default_launch": default,
        "median_ms": ms,
        "gbps": 1000.0 / ms,
        "copy_gbps": 3000.0,
        "fraction_of_copy": 1000.0 / ms / 3000.0,
        "sdpa_ms": 0.5,
        "sdpa_gbps": 2000.0,
        "vs_sdpa": 1000.0 / ms / 2000.0,
        "rel_err": 3e-3,
    }


ROWS = [
    _row("4096", 0.4, {"partition_size": 512, "block_n": 64}),
    _row("4096", 0.35, {"partition_size": 1024, "block_n": 64}, default=False),
    _row("1-8192", 0.5, {"partition_size": 512, "block_n": 64}),
    _row("1-8192", 0.6, {"partition_size": 256, "block_n": 32}, default=False),
]


def test_best_rows_keep_the_fastest_launch_per_context() -> None:
    assert best_rows(ROWS) == [ROWS[1], ROWS[2]]


def test_table_has_a_header_and_one_aligned_line_per_row() -> None:
    header, line = format_table(ROWS[:1]).splitlines()
    assert header.split()[:4] == ["implementation", "context", "launch", "ms"]
    assert line.split() == [
        "triton",
        "4096",
        "ps=512",
        "bn=64",
        "0.400",
        "2500",
        "83%",
        "2000",
        "1.25x",
        "3.0e-03",
    ]
    assert header.index("GB/s") == line.index("2500"), "columns must line up"


def test_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    report = {
        "device": "test",
        "config": {
            "batch_size": 64,
            "num_heads": 32,
            "num_kv_heads": 8,
            "head_size": 128,
            "dtype": "bfloat16",
        },
        "rows": ROWS,
        "best": best_rows(ROWS),
    }
    write_plot(report, str(tmp_path / "k1.png"))
    assert (tmp_path / "k1.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_main_needs_a_cuda_device() -> None:
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main(_parse())
