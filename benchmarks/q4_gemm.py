"""One layer's four Q4 products of SmolLM2-135M (qkv 960 x 576, o 576 x 576, gate_up 3,072 x 576,
down 576 x 1,536) at prefill and batch sizes, every way the CPU path can compute them:

* ``prepacked``: the dense bf16 weight in oneDNN's blocked layout (the dequantized path,
  ``layers/onednn_linear.py``; rows padded to their bucket, as that path pads them);
* ``brgemm``: ``int4_prefill_matmul`` (tiles decoded into AMX's VNNI layout, oneDNN's brgemm);
* ``torch_mm``: tiles decoded row-major, each a torch.mm (``padded_dequantized_matmul``);
* ``int4``: torch's int4 kernel (``aten._weight_int4pack_mm_for_cpu``).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/q4_gemm.py [--rows 16 128 1000]

The candidates run in turn, round after round (a shared machine's load then weighs on each
alike); prints, per row count, each one's layer total (the sum over the four shapes of each
shape's fastest round) in ms and TFLOP/s, as one JSON line. On a shared machine, start it as
``setsid -w sh -c 'echo -20 > /proc/self/autogroup; exec CMD'``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.layers.quantization import gguf as gguf_q4
from pagedllm.layers.row_buckets import pad_rows

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROUNDS = 40


def candidates(num_rows: int, n: int, k: int) -> dict[str, Callable[[], torch.Tensor]]:
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
    return found


def fastest(fns: dict[str, Callable[[], torch.Tensor]]) -> dict[str, float]:
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()  # oneDNN primitives and brgemm kernels built outside the timing
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 128, 1000])
    args = parser.parse_args()
    for num_rows in args.rows:
        totals: dict[str, float] = {}
        for n, k in SHAPES.values():
            for name, seconds in fastest(candidates(num_rows, n, k)).items():
                totals[name] = totals.get(name, 0.0) + seconds
        flops = sum(2 * num_rows * n * k for n, k in SHAPES.values())
        result = {
            name: {"ms": round(s * 1e3, 2), "tflops": round(flops / s / 1e12, 2)}
            for name, s in totals.items()
        }
        print(json.dumps({"rows": num_rows, "layer": result}), flush=True)


if __name__ == "__main__":
    main()
