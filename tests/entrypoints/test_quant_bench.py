"""``pagedllm bench quant``'s arguments and shapes, without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.entrypoints import cli
from pagedllm.entrypoints.bench import quant

CONFIG = Path(__file__).parents[2] / "benchmarks" / "configs" / "llama-3.1-8b" / "config.json"


def test_the_shapes_are_llama_3_1_8b_s_projections() -> None:
    config = json.loads(CONFIG.read_text())
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * d
    assert {"qkv": (h, qkv), "o": (h, h), "gate_up": (h, 2 * i), "down": (i, h)} == quant.SHAPES


def test_bench_quant_parses_and_refuses_to_run_without_cuda(monkeypatch) -> None:
    args = cli.build_parser(["bench", "quant"]).parse_args(["bench", "quant", "--shapes", "o", "--sweep"])
    assert args.num_tokens == [1, 8, 64, 512, 4096] and args.shapes == ["o"] and args.sweep
    monkeypatch.setattr(quant.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        args.func(args)
