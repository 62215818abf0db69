"""One layer's four Q4 products of SmolLM2-135M (qkv 960 x 576, o 576 x 576, gate_up 3,072 x 576,
down 576 x 1,536) at prefill and batch sizes, every way the CPU path can compute them:

* ``prepacked``: the dense bf16 weight in oneDNN's blocked layout (the dequantized path,
  ``layers/onednn_linear.py``; rows padded to their bucket, as that path pads them);
* ``brgemm``: ``int4_prefill_matmul`` (tiles decoded into AMX's VNNI layout, oneDNN's brgemm);
* ``torch_mm``: tiles decoded row-major, each a torch.mm (``padded_dequantized_matmul``);
* ``int4``: torch's int4 kernel (``aten._weight_int4pack_mm_for_cpu``).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/q4_gemm.py [--rows 16 128 1000] [--flush-mb 16]
        [--candidates prepacked brgemm] [--rounds 40] [--clock cpu]

Each round runs every shape's candidates in turn, in reversed order every other round (a shared
machine's load then weighs on each alike), and a candidate's round is its layer total: the sum of
its four products in that round.
``--clock cpu`` times the thread's CPU time instead of the wall clock (on a loaded machine, the
time other processes hold the core is then left out, though not their use of its caches).
``--flush-mb`` reads that many MB between products, evicting L1 and L2 as a model's other work
(attention, the norms) does between two products in the engine; 0 keeps the caches hot. Prints,
per row count, one JSON line: each candidate's median and fastest layer total in ms, TFLOP/s at
the median, and (where ``prepacked`` runs) the median over rounds of prepacked's time over the
candidate's, so that above 1.0 the candidate is the faster. The fastest round alone hides a
kernel's spread; the median is the figure to compare. On a shared machine, start it as
``setsid -w sh -c 'echo -20 > /proc/self/autogroup; exec CMD'``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.layers.quantization import gguf as gguf_q4
from pagedllm.layers.row_buckets import pad_rows

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
CANDIDATES = ("prepacked", "brgemm", "torch_mm", "int4")


def candidates(num_rows: int, n: int, k: int, names: list[str]) -> dict[str, Callable[[], torch.Tensor]]:
    gen = torch.Generator().manual_seed(n + k)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    scales_and_zeros = (torch.rand(k // 32, n, 2, generator=gen) * 0.01).bfloat16()
    blocked = torch.ops.mkldnn._reorder_linear_weight(
        gguf_q4.dequantize_packed(packed, scales_and_zeros, 0, n), 32
    )
    x = torch.randn(num_rows, k, generator=gen).bfloat16()
    found = {
        "prepacked": lambda: torch.ops.mkldnn._linear_pointwise(pad_rows(x), blocked, None, "none", [], ""),
        "torch_mm": lambda: gguf_q4.padded_dequantized_matmul(x, packed, scales_and_zeros),
        "int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros),
    }
    if cpu_ops.int4_prefill_supported():
        found["brgemm"] = lambda: cpu_ops.int4_prefill_matmul(x, packed, scales_and_zeros)
    return {name: fn for name, fn in found.items() if name in names}


def layer_rounds(
    num_rows: int, names: list[str], rounds: int, flush_mb: int, clock: Callable[[], float]
) -> dict[str, list[float]]:
    """Each candidate's layer total (seconds of ``clock``) in each round."""
    shapes = [candidates(num_rows, n, k, names) for n, k in SHAPES.values()]
    flush = torch.ones(flush_mb * 2**20 // 8, dtype=torch.int64)
    for fns in shapes:
        for fn in fns.values():
            fn()  # oneDNN primitives and brgemm kernels built outside the timing
    totals: dict[str, list[float]] = {name: [0.0] * rounds for name in shapes[0]}
    for r in range(rounds):
        for fns in shapes:
            # The order reversed every other round, so that no candidate always follows the same
            # one (a position in the round moved a candidate's median by up to ~10%).
            order = list(fns.items())
            for name, fn in order if r % 2 == 0 else reversed(order):
                if flush_mb:
                    flush.sum()
                start = clock()
                fn()
                totals[name][r] += clock() - start
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 128, 1000])
    parser.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=list(CANDIDATES))
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--flush-mb", type=int, default=0, help="MB read between products (0: hot caches)")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the thread's CPU time, which leaves out the time other processes hold its core",
    )
    args = parser.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    for num_rows in args.rows:
        totals = layer_rounds(num_rows, args.candidates, args.rounds, args.flush_mb, clock)
        flops = sum(2 * num_rows * n * k for n, k in SHAPES.values())
        result = {}
        for name, seconds in totals.items():
            median = statistics.median(seconds)
            result[name] = {
                "median_ms": round(median * 1e3, 2),
                "min_ms": round(min(seconds) * 1e3, 2),
                "median_tflops": round(flops / median / 1e12, 2),
            }
            if "prepacked" in totals:
                ratios = [p / s for p, s in zip(totals["prepacked"], seconds, strict=True)]
                result[name]["median_ratio_to_prepacked"] = round(statistics.median(ratios), 3)
        line = {"rows": num_rows, "flush_mb": args.flush_mb, "clock": args.clock, "layer": result}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
