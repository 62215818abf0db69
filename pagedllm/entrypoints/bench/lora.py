"""``pagedllm bench lora``: Punica's BGMV and SGMV shrink/expand kernels against the torch path's
masked product, on one projection.

A fused q/k/v projection of each ``--shapes`` model's size (Llama-3.1-8B: in 4096, out 4096 + 2 x
1024; Qwen3-0.6B: in 1024, out 2048 + 2 x 1024) with ``--num-slots`` slots of rank ``--rank``
(bf16), at decode and prefill token counts, every token drawn an adapter at random (a quarter
without). All three run the same contract, ``y += (x A[s]^T) B[s]^T`` per token
(``lora/punica.py``): BGMV a program per token, SGMV a tile of tokens of one adapter (its
segments planned once, outside the timing, as the engine plans them once per step); the base
projection itself is timed beside them, for scale. Reports each one's median time over CUDA
events after warm-up (``triton.testing.do_bench``) and the kernels' weight bandwidth (the bytes of
the adapters the batch touches over their time: the decode bound). Prints a table last;
``--output-json`` writes the rows.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch

from pagedllm.entrypoints.bench import write_json


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 16, 64, 256, 4096])
    parser.add_argument("--num-slots", type=int, default=8, help="adapters per step (max_loras)")
    parser.add_argument("--rank", type=int, default=16, help="max_lora_rank")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--output-json", default=None)


# q/k/v projection sizes: (hidden_size, q_size, kv_size), from each model's config.json.
SHAPES = {"llama-3.1-8b": (4096, 4096, 1024), "qwen3-0.6b": (1024, 2048, 1024)}


def _time_ms(fn: Any) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_size(shape: str, num_tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm.lora.punica import LoRABatch

    device = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    slots, rank = args.num_slots, args.rank
    hidden, q_size, kv_size = SHAPES[shape]
    sizes = (q_size, kv_size, kv_size)
    out, width = sum(sizes), 3 * slots * rank
    x = torch.randn(num_tokens, hidden, device=device, generator=gen).bfloat16()
    weight = (torch.randn(out, hidden, device=device, generator=gen) / hidden**0.5).bfloat16()
    lora_a = (0.01 * torch.randn(width, hidden, device=device, generator=gen)).bfloat16()
    lora_b = (0.01 * torch.randn(out, width, device=device, generator=gen)).bfloat16()
    rng = np.random.default_rng(num_tokens)
    token_slots = rng.integers(0, slots, num_tokens)
    token_slots[rng.random(num_tokens) < 0.25] = -1  # a quarter run without adapter
    starts = (sizes[0], sizes[0] + sizes[1])
    batches = {}
    # (name, kernels, has_prefill): SGMV's segments are planned here, outside the timed calls.
    for name, use_kernels, has_prefill in (
        ("bgmv", True, False),
        ("sgmv", True, True),
        ("torch", False, False),
    ):
        batch = LoRABatch(slots, rank, num_tokens, {3}, torch.bfloat16, device, use_kernels=use_kernels)
        batch.set_token_slots(token_slots, has_prefill)
        batches[name] = batch
    y = x @ weight.T
    results = {
        name: _time_ms(lambda b=batch: b.apply(y, x, lora_a, lora_b, 3, starts))
        for name, batch in batches.items()
    }
    base_ms = _time_ms(lambda: x @ weight.T)
    # Bytes of the adapters the batch reads: each distinct slot's A rows and B columns once.
    num_adapters = len({int(s) for s in token_slots if s >= 0})
    adapter_bytes = num_adapters * 3 * rank * (hidden + out / 3) * 2
    return {
        "shape": shape,
        "num_tokens": num_tokens,
        "num_adapters": num_adapters,
        "bgmv_ms": results["bgmv"],
        "sgmv_ms": results["sgmv"],
        "torch_ms": results["torch"],
        "base_projection_ms": base_ms,
        "bgmv_adapter_gb_s": adapter_bytes / results["bgmv"] / 1e6,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "shape          tokens  adapters  bgmv ms  sgmv ms  torch ms  bgmv/sgmv  base ms  "
        "bgmv GB/s (adapters)"
    ]
    for r in rows:
        lines.append(
            f"{r['shape']:13s}  {r['num_tokens']:6d}  {r['num_adapters']:8d}  {r['bgmv_ms']:7.4f}  "
            f"{r['sgmv_ms']:7.4f}  {r['torch_ms']:8.4f}  {r['bgmv_ms'] / r['sgmv_ms']:9.2f}  "
            f"{r['base_projection_ms']:7.4f}  {r['bgmv_adapter_gb_s']:9.1f}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("pagedllm bench lora needs a CUDA device")
    rows = [bench_size(shape, n, args) for shape in args.shapes for n in args.num_tokens]
    report = {"device": torch.cuda.get_device_name(), "config": vars(args) | {"func": None}, "rows": rows}
    print(format_table(rows))
    write_json(args.output_json, report)
    return report
