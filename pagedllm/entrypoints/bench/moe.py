"""``pagedllm bench moe``: the fused MoE kernel against the per-expert torch reference.

One Qwen3-30B-A3B MoE layer (128 experts, top-8, hidden 2048, expert width 768, bf16) at a decode
size (64 tokens) and a prefill size (8192 tokens): random router logits, the same routing for
both. The reference is the torch path (``fused_experts_torch``: tokens sorted by expert, two
matmuls per expert that got tokens). Reports each one's median time, the ratio, and the fused
kernel's weight bandwidth (bytes of the experts touched over time; the decode bound) and TFLOP/s
(the prefill bound). ``--sweep`` also times the launches worth trying at each size (short tiles
at decode sizes, large ones at prefill sizes), the whole MoE and each GEMM on its own, and reports
the best, so that tuning takes one call on the device. Prints a table last; ``--output-json``
writes the rows.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import asdict
from typing import Any

import torch

from pagedllm.entrypoints.bench import write_json
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


def _sweep_space(pairs_per_expert: float) -> list[Any]:
    """Launches worth timing at a size: short tiles and long K steps at decode sizes (a few pairs
    per expert, the weights the bound), square-ish tiles and deep pipelines at prefill sizes."""
    from pagedllm.kernels.triton.fused_moe import MoeLaunch

    if pairs_per_expert <= 48:
        space = [
            MoeLaunch(m, n, k, 1 if m == 16 else 16, 4, s)
            for m, n, k, s in itertools.product((16, 32), (64, 128), (128, 256), (2, 3, 4))
        ]
        space += [MoeLaunch(m, 128, 128, 1 if m == 16 else 16, 8, 2) for m in (16, 32)]
    else:
        space = [
            MoeLaunch(m, n, k, 16, w, s)
            for m, n, k, w, s in itertools.product((64, 128), (64, 128), (64, 128), (4, 8), (3, 4))
        ]
    # Shared memory holds num_stages x (x tile + gate and up tiles) at 16 bits; 227 KiB on Hopper.
    return [c for c in space if c.num_stages * (c.block_m + 2 * c.block_n) * c.block_k * 2 <= 224 * 1024]


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
        row.update(_sweep(x, w13, w2, weights, ids, torch_ms))
    return row


def _sweep(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    torch_ms: float,
) -> dict[str, Any]:
    """Every launch of the size's space: the whole fused MoE, and each GEMM on its own (they may
    want different tiles: K is the hidden size in the first, the expert width in the second)."""
    from pagedllm.kernels.triton.fused_moe import _launch_gemm, fused_moe
    from pagedllm.kernels.triton.moe_align import moe_align_block_size

    num_tokens, top_k = ids.shape
    e, two_i, _ = w13.shape
    num_pairs = num_tokens * top_k
    flat_weights = weights.contiguous()
    intermediate = x.new_empty(num_pairs, two_i // 2)
    out = x.new_empty(num_pairs, x.shape[1])
    timed = []
    for c in _sweep_space(num_pairs / e):
        try:
            aligned = moe_align_block_size(ids, c.block_m, e)
            whole = _time_ms(lambda c=c: fused_moe(x, w13, w2, weights, ids, c))
            gate_up = _time_ms(
                lambda c=c, a=aligned: _launch_gemm(x, w13, intermediate, flat_weights, *a, top_k, True, c)
            )
            down = _time_ms(
                lambda c=c, a=aligned: _launch_gemm(intermediate, w2, out, flat_weights, *a, 1, False, c)
            )
        except Exception as exc:  # a launch that does not fit the device (shared memory): skip it
            print(f"skipped {c}: {type(exc).__name__}")
            continue
        timed.append({"launch": asdict(c), "ms": whole, "gate_up_ms": gate_up, "down_ms": down})
    best = min(timed, key=lambda t: t["ms"])
    return {
        "best_ms": best["ms"],
        "best_launch": best["launch"],
        "best_speedup": torch_ms / best["ms"],
        "best_gate_up": min(timed, key=lambda t: t["gate_up_ms"]),
        "best_down": min(timed, key=lambda t: t["down_ms"]),
        "sweep": sorted(timed, key=lambda t: t["ms"]),
    }


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
            for gemm in ("gate_up", "down"):
                best = row[f"best_{gemm}"]
                line += f"; best {gemm} {best[gemm + '_ms']:.3f} ms {best['launch']}"
        print(line)
    write_json(args.output_json, result)
    return result
