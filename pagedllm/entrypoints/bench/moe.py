"""``pagedllm bench moe``: the fused MoE kernel against the per-expert torch reference.

One Qwen3-30B-A3B MoE layer (128 experts, top-8, hidden 2048, expert width 768, bf16) at a decode
size (64 tokens) and a prefill size (8192 tokens): random router logits, the same routing for
both. The reference is the torch path (``fused_experts_torch``: tokens sorted by expert, two
matmuls per expert that got tokens). Reports each one's median time, the ratio, and the fused
kernel's weight bandwidth (bytes of the experts touched over time; the decode bound) and TFLOP/s
(the prefill bound). ``--sweep`` also times every launch of ``SWEEP`` and reports the best, so
that tuning takes one call on the device. Prints a table last; ``--output-json`` writes the rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict
from typing import Any

import torch

from pagedllm.layers.fused_moe import fused_experts_torch, select_experts

# Qwen3-30B-A3B's layer.
NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 128, 8, 2048, 768


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num-tokens", type=int, nargs="+", default=[64, 8192], help="decode and prefill sizes"
    )
    parser.add_argument("--num-experts", type=int, default=NUM_EXPERTS)
    parser.add_argument("--top-k", type=int, default=TOP_K)
    parser.add_argument("--hidden-size", type=int, default=HIDDEN)
    parser.add_argument("--intermediate-size", type=int, default=INTERMEDIATE)
    parser.add_argument("--sweep", action="store_true", help="also time every launch of the sweep space")
    parser.add_argument("--output-json", default=None)


def _sweep_space() -> list[Any]:
    from pagedllm.kernels.triton.fused_moe import MoeLaunch

    # Grouping only matters with several tiles per expert (it shares weight tiles in L2).
    return [
        MoeLaunch(m, n, k, 1 if m == 16 else 8, w, s)
        for m, n, k, w, s in itertools.product((16, 32, 64), (64, 128), (64, 128), (4, 8), (3, 4))
    ]


def _time_ms(fn: Any) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_size(num_tokens: int, args: argparse.Namespace, sweep: bool) -> dict[str, Any]:
    from pagedllm.kernels.triton.fused_moe import default_launch, fused_moe

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    e, h, i = args.num_experts, args.hidden_size, args.intermediate_size
    x = torch.randn(num_tokens, h, device="cuda", generator=gen).bfloat16()
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) / i**0.5).bfloat16()
    logits = torch.randn(num_tokens, e, device="cuda", generator=gen)
    weights, ids = select_experts(logits, args.top_k, renormalize=True)
    launch = default_launch(num_tokens * args.top_k, e, x.dtype)
    fused_ms = _time_ms(lambda: fused_moe(x, w13, w2, weights, ids, launch))
    torch_ms = _time_ms(lambda: fused_experts_torch(x, w13, w2, weights, ids))
    num_touched = int(torch.unique(ids).numel())
    weight_bytes = num_touched * 3 * h * i * x.element_size()
    flops = 6 * num_tokens * args.top_k * h * i
    row = {
        "num_tokens": num_tokens,
        "experts_touched": num_touched,
        "launch": asdict(launch),
        "fused_ms": fused_ms,
        "torch_ms": torch_ms,
        "speedup": torch_ms / fused_ms,
        "fused_weight_gbps": weight_bytes / (fused_ms * 1e-3) / 1e9,
        "fused_tflops": flops / (fused_ms * 1e-3) / 1e12,
    }
    if sweep:
        timed = []
        for candidate in _sweep_space():
            try:
                timed.append(
                    (_time_ms(lambda c=candidate: fused_moe(x, w13, w2, weights, ids, c)), candidate)
                )
            except Exception as exc:  # a launch that does not fit the device (shared memory): skip it
                print(f"skipped {candidate}: {type(exc).__name__}")
        best_ms, best = min(timed, key=lambda t: t[0])
        row.update(best_ms=best_ms, best_launch=asdict(best), best_speedup=torch_ms / best_ms)
    return row


def main(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("pagedllm bench moe needs a CUDA device")
    rows = [bench_size(n, args, args.sweep) for n in args.num_tokens]
    result = {"device": torch.cuda.get_device_name(), "rows": rows}
    for row in rows:
        line = (
            f"MoE {row['num_tokens']} tokens ({row['experts_touched']} experts): "
            f"fused {row['fused_ms']:.3f} ms, torch per-expert {row['torch_ms']:.3f} ms "
            f"({row['speedup']:.1f}x); fused "
            f"{row['fused_weight_gbps']:.0f} GB/s of expert weights, {row['fused_tflops']:.0f} TFLOP/s"
        )
        if "best_ms" in row:
            line += f"; best launch {row['best_ms']:.3f} ms ({row['best_speedup']:.1f}x) {row['best_launch']}"
        print(line)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result
