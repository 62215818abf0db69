"""``pagedllm bench kernels`` end to end on CUDA, on a small batch: a uniform and a ragged context
(dense and jagged SDPA), a two-launch sweep, the JSON and the plot. Run with -s to see the table."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton kernels", allow_module_level=True)
pytest.importorskip("triton", reason="the benchmark times the triton kernels")

from pagedllm.entrypoints.bench.kernels import add_cli_args, main
from pagedllm.kernels.bench import DECODE_IMPLS

pytestmark = pytest.mark.gpu


def test_small_run_with_a_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two extra launches: each compiles its own kernel, and the full grid takes minutes.
    small_sweep = dataclasses.replace(DECODE_IMPLS["triton"], sweep_space={"block_n": (32, 128)})
    monkeypatch.setitem(DECODE_IMPLS, "triton", small_sweep)
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    json_path, png_path = tmp_path / "k1.json", tmp_path / "k1.png"
    argv = ["--contexts", "1024", "1-2048", "--batch-size", "16", "--sweep", "--implementations", "triton"]
    report = main(parser.parse_args([*argv, "--output-json", str(json_path), "--output-png", str(png_path)]))

    assert [(row["context"], row["default_launch"]) for row in report["rows"]] == [
        (context, is_default) for context in ("1024", "1-2048") for is_default in (True, False, False)
    ]
    for row in report["rows"]:
        assert row["gbps"] > 0 and row["sdpa_gbps"] > 0 and 0 < row["fraction_of_copy"] < 1.5
        # bf16 attention, two implementations: agreement to bf16 rounding, and no NaN (unwritten).
        assert row["rel_err"] < 2e-2, row
    assert len(report["best"]) == 2
    assert json.loads(json_path.read_text()) == report
    assert png_path.read_bytes().startswith(b"\x89PNG")


def test_windowed_rows_beside_the_unwindowed_ones() -> None:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    argv = ["--contexts", "8192", "1-4096", "--batch-size", "16", "--sliding-window", "512"]
    report = main(parser.parse_args([*argv, "--implementations", "triton", "cuda-v1"]))
    windowed = [row for row in report["rows"] if "sliding_window" in row]
    assert [(row["implementation"], row["context"]) for row in windowed] == [
        ("triton (window 512)", "8192"),
        ("triton (window 512)", "1-4096"),
    ]
    for row in windowed:
        assert row["rel_err"] < 2e-2, row  # against SDPA over the same window
    # Reading 512 of 8192 tokens must be much faster than reading all of them.
    assert windowed[0]["speedup_vs_unwindowed"] > 4, windowed[0]
