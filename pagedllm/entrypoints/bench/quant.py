"""``pagedllm bench quant``: every quantized GEMM path at Llama-3.1-8B's layer shapes, from decode
(1 and 8 tokens) to prefill sizes.

Shapes (``[K -> N]``, TP=1): qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672, down
14336 -> 4096. Paths, each on the same random weights of its format:

    bf16            F.linear, the unquantized baseline
    fp8 W8A8        the FP8 layer's _scaled_mm path (activation quantization included)
    fp8 skinny      the FP8 layer's weight-only kernel (kernels/triton/skinny_gemm.py)
    fp8-block W8A8  the 128 x 128 block-scaled Triton GEMM (kernels/triton/quant_gemm.py)
    fp8-block skinny
    w4a16 GEMM      the Triton W4A16 GEMM, groups of 128
    w4a16 skinny

The skinny kernels run at up to 64 tokens (they are chosen at up to ``SKINNY_MAX_M``: the rows
past it show the crossover). Each time is a median of ``triton.testing.do_bench`` (CUDA events,
after warm-up, the L2 cache flushed between runs: an 8B layer's weights would otherwise partly
hit it). Reported per row: ms, the weight bytes the path reads over its time (GB/s) and their
fraction of the device's copy bandwidth (bytes read + written per second, as the W3 floor uses),
and TFLOP/s. ``--sweep`` also times the skinny kernels' launch alternatives from 1 to 16 tokens,
each in a CUDA graph over weight copies that miss L2, as a decode step runs them.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# Llama-3.1-8B's projections at TP=1: name -> (K, N).
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
W4A16_GROUP = 128
FP8_BLOCK = (128, 128)
SKINNY_TIMED_MAX_M = 64


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time the skinny kernels' launch alternatives (1 to 16 tokens, CUDA graphs)",
    )
    parser.add_argument("--output-json", default=None)


def _median_ms(fn: Callable[[], Any]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _fp8_layer(k: int, n: int) -> torch.nn.Module:
    """A bf16 layer quantized to FP8 per output channel at load (vLLM's online FP8), on CUDA."""
    from pagedllm.layers.linear import ReplicatedLinear
    from pagedllm.layers.quantization.fp8 import ActivationScheme, Fp8LinearMethod, Fp8Scheme, WeightScheme

    with torch.device("cuda"):
        layer = ReplicatedLinear(k, n, bias=False).bfloat16()
    layer.weight.data.normal_(0.0, 0.02)
    method = Fp8LinearMethod(Fp8Scheme(WeightScheme.CHANNEL, ActivationScheme.DYNAMIC_TOKEN, online=True))
    method.create_weights(layer)
    layer.quant_method = method
    method.process_weights_after_loading(layer)
    return layer


def shape_paths(k: int, n: int) -> dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor], bool]]:
    """name -> (weight bytes read, product of x, skinny) for one [K -> N] projection."""
    from pagedllm.kernels.triton.quant_gemm import fp8_block_gemm, w4a16_gemm
    from pagedllm.kernels.triton.skinny_gemm import skinny_gemm

    gen = torch.Generator(device="cuda").manual_seed(k + n)
    dense = (0.02 * torch.randn(n, k, device="cuda", generator=gen)).bfloat16()
    layer = _fp8_layer(k, n)
    method = layer.quant_method
    bn, bk = FP8_BLOCK
    block_w = torch.randn(n, k, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    block_s = torch.rand(-(-n // bn), -(-k // bk), device="cuda", generator=gen) * 0.01
    g = W4A16_GROUP
    qweight = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32, generator=gen)
    scales = (torch.rand(n, k // g, device="cuda", generator=gen) * 0.01).bfloat16()
    zeros = torch.full((n, k // g), 8.0, device="cuda", dtype=torch.bfloat16)
    fp8_bytes = n * k + 4 * n
    block_bytes = n * k + 4 * block_s.numel()
    w4_bytes = n * k // 2 + 2 * (scales.numel() + zeros.numel())
    return {
        "bf16": (2 * n * k, lambda x: F.linear(x, dense), False),
        "fp8 W8A8": (fp8_bytes, lambda x: method.apply_scaled_mm(layer, x), False),
        "fp8 skinny": (fp8_bytes, lambda x: method.apply_skinny(layer, x), True),
        "fp8-block W8A8": (block_bytes, lambda x: fp8_block_gemm(x, block_w, block_s, FP8_BLOCK), False),
        "fp8-block skinny": (block_bytes, lambda x: skinny_gemm(x, block_w, block_s, bk, bn), True),
        "w4a16 GEMM": (w4_bytes, lambda x: w4a16_gemm(x, qweight, scales, zeros, g), False),
        "w4a16 skinny": (w4_bytes, lambda x: skinny_gemm(x, qweight, scales, g, zeros=zeros), True),
    }


def bench_shape(name: str, num_tokens: list[int], copy_bytes_per_s: float) -> list[dict[str, Any]]:
    k, n = SHAPES[name]
    rows = []
    for path, (weight_bytes, product, skinny) in shape_paths(k, n).items():
        for m in num_tokens:
            if skinny and m > SKINNY_TIMED_MAX_M:
                continue
            x = torch.randn(m, k, device="cuda").bfloat16()
            ms = _median_ms(lambda p=product, x=x: p(x))
            rows.append(
                {
                    "shape": name,
                    "k": k,
                    "n": n,
                    "num_tokens": m,
                    "path": path,
                    "ms": ms,
                    "weight_gb_s": weight_bytes / ms / 1e6,
                    "copy_fraction": weight_bytes / (ms * 1e-3) / copy_bytes_per_s,
                    "tflops": 2 * m * n * k / ms / 1e9,
                }
            )
    return rows


# The skinny kernels' launch alternatives: (block_n, block_k, num_warps) per format and product
# (fma 0: tensor cores, 1: registers), and the K splits tried with each.
SWEEP_TILES = {
    ("fp8", 0): ((32, 512, 4), (32, 128, 4), (64, 256, 4), (16, 512, 4)),
    ("fp8", 1): ((8, 512, 4), (16, 512, 2), (16, 256, 1), (32, 256, 2), (8, 1024, 2), (4, 1024, 1)),
    ("w4a16", 0): ((16, 256, 4), (32, 128, 4), (64, 128, 4)),
    ("w4a16", 1): (
        (8, 512, 4),
        (16, 256, 1),
        (16, 512, 2),
        (32, 256, 2),
        (16, 256, 2),
        (8, 1024, 2),
        (4, 1024, 1),
    ),
}
SWEEP_SPLITS = {0: (1, 2, 4), 1: (1, 2)}
SWEEP_ROWS = (1, 4, 8, 16)
# Weight copies per timed graph: enough bytes that no launch finds its weight in L2.
_COPY_BYTES = 240_000_000


def sweep_skinny(name: str) -> list[dict[str, Any]]:
    """The skinny kernels' launch alternatives at ``SWEEP_ROWS`` rows (FP8 per channel, W4A16 groups
    of 128), each timed in a CUDA graph over weight copies (``graph_median_us``); bf16's F.linear beside."""
    from pagedllm.kernels.bench import graph_median_us
    from pagedllm.kernels.triton.skinny_gemm import FMA_MAX_M, skinny_gemm

    k, n = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(k * n)
    formats: dict[str, tuple[int, Callable[[], Any], Callable[..., Any]]] = {
        "bf16": (
            2 * n * k,
            lambda: (0.02 * torch.randn(n, k, device="cuda", generator=gen)).bfloat16(),
            lambda x, w, launch: F.linear(x, w),
        ),
        "fp8": (
            n * k,
            lambda: (
                torch.randn(n, k, device="cuda", generator=gen).to(torch.float8_e4m3fn),
                torch.rand(n, 1, device="cuda", generator=gen),
            ),
            lambda x, w, launch: skinny_gemm(x, w[0], w[1], k, launch=launch),
        ),
        "w4a16": (
            n * k // 2,
            lambda: (
                torch.randint(0, 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32, generator=gen),
                torch.rand(n, k // W4A16_GROUP, device="cuda", generator=gen).bfloat16(),
            ),
            lambda x, w, launch: skinny_gemm(x, w[0], w[1], W4A16_GROUP, zeros=w[1], launch=launch),
        ),
    }
    rows = []
    for fmt, (weight_bytes, make, product) in formats.items():
        copies = [make() for _ in range(max(2, -(-_COPY_BYTES // weight_bytes)))]
        for m in SWEEP_ROWS:
            x = torch.randn(m, k, device="cuda").bfloat16()
            launches: list[dict[str, int] | None] = [None]  # bf16; the skinny kernels' default
            if fmt != "bf16":
                for fma in (0, 1) if m <= FMA_MAX_M else (0,):
                    for (bn, bk, warps), splits in itertools.product(
                        SWEEP_TILES[fmt, fma], SWEEP_SPLITS[fma]
                    ):
                        stages = 5 if not fma and k >= 8192 else 3
                        launches.append({"block_n": bn, "block_k": bk, "num_warps": warps,
                                         "num_stages": stages, "fma": fma, "num_splits": splits})  # fmt: skip
            for launch in launches:
                calls = [functools.partial(product, x, w, launch) for w in copies]
                us = graph_median_us(calls)
                rows.append({"shape": name, "format": fmt, "num_tokens": m, "launch": launch or "default",
                             "us": us, "weight_gb_s": weight_bytes / us / 1e3})  # fmt: skip
        del copies
        torch.cuda.empty_cache()
    return rows


# The table's columns: (row key, heading, alignment, width, number format).
COLUMNS = (
    ("shape", "shape", "<", 8, ""), ("num_tokens", "tokens", ">", 6, "d"), ("path", "path", "<", 17, ""),
    ("ms", "ms", ">", 8, ".4f"), ("weight_gb_s", "GB/s", ">", 7, ".0f"),
    ("copy_fraction", "copy", ">", 5, ".2f"), ("tflops", "TFLOP/s", ">", 7, ".1f"),
)  # fmt: skip


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per row, under a heading."""
    lines = [" ".join(f"{title:{align}{width}}" for _, title, align, width, _ in COLUMNS)]
    for r in rows:
        lines.append(" ".join(f"{r[key]:{align}{width}{fmt}}" for key, _, align, width, fmt in COLUMNS))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("pagedllm bench quant needs a CUDA device")
    from pagedllm.entrypoints.bench.ceilings import copy_bandwidth
    from pagedllm.layers.quantization.fp8 import scaled_mm_supported

    if not scaled_mm_supported(torch.device("cuda")):
        raise SystemExit("pagedllm bench quant needs FP8 tensor cores (compute capability 8.9 or 9.0+)")
    copy_bytes_per_s = copy_bandwidth()
    torch.cuda.empty_cache()
    rows = [
        row for name in args.shapes for row in bench_shape(name, sorted(args.num_tokens), copy_bytes_per_s)
    ]
    rows.sort(key=lambda r: (r["shape"], r["num_tokens"]))
    print(format_table(rows))
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "copy_gb_s": copy_bytes_per_s / 1e9,
        "rows": rows,
    }
    if args.sweep:
        sweep = [row for name in args.shapes for row in sweep_skinny(name)]
        key = lambda r: (r["shape"], r["format"], r["num_tokens"])  # noqa: E731
        for (shape, fmt, m), group in itertools.groupby(sorted(sweep, key=key), key=key):
            group = list(group)
            best = min(group, key=lambda r: r["us"])
            default = next(r for r in group if r["launch"] == "default")
            print(f"{fmt} at {shape}, {m} tokens: default {default['us']:.1f} us, best {best['us']:.1f} us "
                  f"({best['weight_gb_s']:.0f} GB/s of weights) {best['launch']}")  # fmt: skip
        report["sweep"] = sweep
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
    return report
