"""``pagedllm bench ...``: one module per benchmark, each with ``add_cli_args(parser)`` and
``main(args)``: ``throughput`` (W1, W2, W5, W6, W7), ``latency`` (W3), ``serve`` (online serving,
W4), ``kernels`` (decode attention, K1), ``mla`` (MLA decode against FlashInfer's, K1-MLA), ``moe``
(the fused MoE kernel). The workloads are in
``workloads.py``; the device ceilings in ``ceilings.py``; the MoE floor in ``moe_floor.py``."""

from __future__ import annotations

import json
from typing import Any


def write_json(path: str | None, report: dict[str, Any], indent: int = 1) -> None:
    """Write a benchmark's report to ``path`` (its --output-json), when one is given."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=indent)
