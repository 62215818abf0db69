"""benchmarks/variants: each timing variant takes effect in every process started with it (the
spawned ranks included), an unknown one stops the process naming it; the GPU summary sets each
variant's W3 beside the plain run of its tensor-parallel size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_w6_bench import load_gpu_summary

ROOT = Path(__file__).resolve().parents[2]
# What each variant may patch, as the engine's modules see it once imported.
PROBE = """
import pagedllm.attention.backends.triton_backend as t
import pagedllm.layers.layernorm as norm
import pagedllm.layers.linear as linear
print(t.TritonAttentionBackend.appends_in_decode, t.paged_decode.__name__, t.decode_partition_size.__name__,
      linear.tensor_model_parallel_all_reduce.__name__, norm.get_symm_mem_all_reduce.__name__)
"""
PLAIN = "True paged_decode decode_partition_size tensor_model_parallel_all_reduce get_symm_mem_all_reduce"


def _run(variant: str) -> subprocess.CompletedProcess:
    paths = f"{ROOT / 'benchmarks' / 'variants'}{os.pathsep}{ROOT}"
    env = {**os.environ, "PAGEDLLM_BENCH_VARIANT": variant, "PYTHONPATH": paths}
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "variant, patched, says_wrong",
    [
        ("", PLAIN, False),
        ("separate-cache-write", PLAIN.replace("True", "False"), False),
        ("no-decode-attention", PLAIN.replace("paged_decode", "<lambda>", 1), True),
        (
            "no-all-reduce",
            PLAIN.replace("tensor_model_parallel_all_reduce", "<lambda>").replace(
                "get_symm_mem_all_reduce", "<lambda>"
            ),
            True,
        ),
        ("decode-partitions-64", PLAIN.replace("decode_partition_size", "<lambda>"), False),
    ],
)
def test_a_variant_patches_what_it_names_and_nothing_else(variant, patched, says_wrong):
    result = _run(variant)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == patched
    assert ("the outputs are wrong" in result.stderr) == says_wrong


def test_an_unknown_variant_stops_the_process_naming_it():
    result = _run("no-such-thing")
    assert result.returncode == 2
    assert "PAGEDLLM_BENCH_VARIANT='no-such-thing': no such variant" in result.stderr


def test_summary_sets_each_variant_beside_its_plain_run(tmp_path):
    runs = [
        ("w3v_base_tp1", 4.5),
        ("w3v_separate-cache-write_tp1", 4.7),
        ("w3v_base_tp2", 3.3),
        ("w3v_no-all-reduce_tp2", 2.9),
    ]
    for name, tpot in runs:
        (tmp_path / f"{name}.json").write_text(json.dumps({"cuda_graphs": {"tpot_ms": tpot}}))
    assert load_gpu_summary()._variant_rows(str(tmp_path)) == [
        ("W3 TP=2 no-all-reduce", "ms/token (against the plain run)", "2.90 (-0.40 against 3.30)"),
        ("W3 TP=1 separate-cache-write", "ms/token (against the plain run)", "4.70 (+0.20 against 4.50)"),
    ]
