"""``pagedllm bench ...``: one module per benchmark, each with ``add_cli_args(parser)`` and
``main(args)``: ``throughput`` (W1, W2, W5, W6, W7), ``latency`` (W3), ``serve`` (online serving,
W4), ``kernels`` (decode attention, K1), ``mla`` (MLA decode against FlashInfer's, K1-MLA), ``moe``
(the fused MoE kernel). The workloads are in
``workloads.py``; the device ceilings in ``ceilings.py``; the MoE floor in ``moe_floor.py``."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.engine.arg_utils import EngineArgs


def write_json(path: str | None, report: dict[str, Any], indent: int = 1) -> None:
    """Write a benchmark's report to ``path`` (its --output-json), when one is given."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=indent)


def add_synthetic_acceptance_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--synthetic-acceptance-rate",
        type=float,
        default=None,
        help="benchmark only, with --speculative-config: draft every step and accept each drafted token "
        "with this probability whatever the model says, to measure drafting and verifying on dummy "
        "weights (every figure is labelled synthetic; the outputs are not the model's)",
    )


def with_synthetic_acceptance(engine_args: EngineArgs, rate: float | None) -> EngineArgs:
    """The engine arguments with ``rate`` in their speculative config (benchmarks only)."""
    if rate is None:
        return engine_args
    config = engine_args.speculative_config
    if config is None:
        raise SystemExit("--synthetic-acceptance-rate needs --speculative-config")
    config = dict(json.loads(config) if isinstance(config, str) else config)
    return dataclasses.replace(engine_args, speculative_config={**config, "synthetic_acceptance_rate": rate})
