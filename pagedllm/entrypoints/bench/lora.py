"""``pagedllm bench lora``: Punica's BGMV shrink/expand kernels against the torch path's masked
product, on one projection.

A fused q/k/v projection of a model's shape (default: Llama-3.1-8B's, in 4096, out 4096 + 2 x
1024; ``--hidden-size``/``--q-size``/``--kv-size`` change it) with ``--num-slots`` slots of rank
``--rank`` (bf16), at decode and prefill token counts, every token drawn an adapter at random (a
quarter without). Both run the same contract, ``y += (x A[s]^T) B[s]^T`` per token
(``lora/punica.py``); the base projection itself is timed beside them, for scale. Reports each
one's median time (``triton.testing.do_bench``) and the kernels' weight bandwidth (the bytes of
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
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    parser.add_argument("--num-slots", type=int, default=8, help="adapters per step (max_loras)")
    parser.add_argument("--rank", type=int, default=16, help="max_lora_rank")
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--q-size", type=int, default=4096)
    parser.add_argument("--kv-size", type=int, default=1024)
    parser.add_argument("--output-json", default=None)


def _time_ms(fn: Any) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_size(num_tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm.lora.punica import LoRABatch

    device = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    slots, rank, hidden = args.num_slots, args.rank, args.hidden_size
    sizes = (args.q_size, args.kv_size, args.kv_size)
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
    for name, use_kernels in (("bgmv", True), ("torch", False)):
        batch = LoRABatch(slots, rank, num_tokens, {3}, torch.bfloat16, device, use_kernels=use_kernels)
        batch.set_token_slots(token_slots)
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
        "num_tokens": num_tokens,
        "num_adapters": num_adapters,
        "bgmv_ms": results["bgmv"],
        "torch_ms": results["torch"],
        "base_projection_ms": base_ms,
        "bgmv_adapter_gb_s": adapter_bytes / results["bgmv"] / 1e6,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["tokens  adapters  bgmv ms  torch ms  torch/bgmv  base ms  bgmv GB/s (adapters)"]
    for r in rows:
        lines.append(
            f"{r['num_tokens']:6d}  {r['num_adapters']:8d}  {r['bgmv_ms']:7.4f}  {r['torch_ms']:8.4f}  "
            f"{r['torch_ms'] / r['bgmv_ms']:10.2f}  {r['base_projection_ms']:7.4f}  "
            f"{r['bgmv_adapter_gb_s']:9.1f}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("pagedllm bench lora needs a CUDA device")
    rows = [bench_size(n, args) for n in args.num_tokens]
    report = {"device": torch.cuda.get_device_name(), "config": vars(args) | {"func": None}, "rows": rows}
    print(format_table(rows))
    write_json(args.output_json, report)
    return report
