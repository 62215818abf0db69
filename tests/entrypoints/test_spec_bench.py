"""The speculation benchmarks' plumbing: ``--synthetic-acceptance-rate`` on ``bench throughput``
(W1 at a batch size, with drafts) and the GPU summary's ratios against no speculation."""

from __future__ import annotations

import argparse
import json
import os

import pytest
from test_w6_bench import load_gpu_summary

from pagedllm.entrypoints.bench import throughput

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse(*argv: str) -> argparse.Namespace:
    return throughput.add_cli_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_throughput_puts_the_synthetic_rate_in_the_speculative_config() -> None:
    ngram = '{"method": "ngram", "num_speculative_tokens": 3}'
    args = _parse("--max-num-seqs", "64", "--speculative-config", ngram, "--synthetic-acceptance-rate", "0.5")
    workload = throughput.workload_for(args)
    engine_args = throughput.engine_args_for(workload, args)
    assert engine_args.speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "synthetic_acceptance_rate": 0.5,
    }
    assert engine_args.max_num_seqs == 64
    assert throughput.engine_args_for(workload, _parse()).speculative_config is None


def test_a_synthetic_rate_without_a_speculative_config_is_refused() -> None:
    args = _parse("--synthetic-acceptance-rate", "0.5")
    with pytest.raises(SystemExit, match="--speculative-config"):
        throughput.engine_args_for(throughput.workload_for(args), args)


def test_summary_gives_speculation_over_none_in_the_same_call(tmp_path) -> None:
    files = {
        "w3": {"cuda_graphs": {"tpot_ms": 4.0}},
        "w3_eagle_1.0": {"cuda_graphs": {"tpot_ms": 1.2}},
        "w3_spec": {"cuda_graphs": {"tpot_ms": 1.1}, "synthetic_acceptance_rate": 1.0},
        "w1_b64": {"output_tok_s": 20000.0},
        "w1_spec_b64": {"output_tok_s": 10000.0, "synthetic_acceptance_rate": 0.5},
        "spec_editing_device": {"speedup": 1.7, "identical": True, "dtype": "float32", "lookup": "device"},
    }
    for name, report in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(report))
    summary = load_gpu_summary()
    assert summary._spec_rows(str(tmp_path)) == [
        ("W3 eagle_1.0 / W3", "ms/token (synthetic)", "0.300x"),
        ("W3 ngram verify step / decode step", "ms (synthetic 1.0)", "1.10x"),
        ("W1 batch 64 ngram / none", "output tok/s, synthetic 0.5", "0.50x (10000)"),
        ("editing ngram / none (float32, device)", "output tok/s, real weights", "1.70x, identical True"),
    ]
