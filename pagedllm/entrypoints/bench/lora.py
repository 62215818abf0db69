"""``pagedllm bench lora``: Punica's BGMV and SGMV shrink/expand kernels against the torch path's
masked product, on one projection.

A fused q/k/v projection of each ``--shapes`` model's size (Llama-3.1-8B: in 4096, out 4096 + 2 x
1024; Qwen3-0.6B: in 1024, out 2048 + 2 x 1024) with ``--num-slots`` slots of rank ``--rank``
(bf16), at decode and prefill token counts, every token drawn an adapter at random (a quarter
without). All run the same contract, ``y += (x A[s]^T) B[s]^T`` per token (``lora/punica.py``):
BGMV a program per token; SGMV a tile of tokens of one adapter over exactly the step's tiles, as
in a prefill step (its segments planned once, outside the timing, as the engine plans them once
per step); "decode" what a decode step runs (BGMV below 16 tokens, SGMV over a grid fixed by the
token count from there); the torch product. The base projection is timed beside them, for
scale. Reports each one's median time over CUDA events after warm-up (``triton.testing.do_bench``)
and BGMV's weight bandwidth (the bytes of the adapters the batch touches over its time: the decode
bound).

First, a W1-like prefill step (``--prefill-tokens``, default 4096, of requests of 100 to 1024
tokens, request i on adapter i mod ``--num-slots``, as ``bench throughput --num-loras``) through
each projection LoRA wraps in Qwen3-0.6B (q/k/v, o, gate/up, down), SGMV and BGMV: the first call
timed on its own, with Triton's cache pointed at an empty directory (a fresh compile, what a
variant costs when it first meets a step; a projection whose kernel Triton specialises as an
earlier one's reuses its compile), then the median. Prints the tables last; ``--output-json``
writes the rows.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import tempfile
import time
from typing import Any

import numpy as np
import torch

from pagedllm.entrypoints.bench import write_json
from pagedllm.entrypoints.bench.workloads import WORKLOADS


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 16, 64, 256, 4096])
    parser.add_argument("--num-slots", type=int, default=8, help="adapters per step (max_loras)")
    parser.add_argument("--rank", type=int, default=16, help="max_lora_rank")
    parser.add_argument("--shapes", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument(
        "--prefill-tokens", type=int, default=4096, help="tokens of the W1-like prefill step (0: skip it)"
    )
    parser.add_argument("--output-json", default=None)


DEVICE = "cuda"

# The models whose projections are timed: their workloads' config.json.
MODELS = {"llama-3.1-8b": WORKLOADS["W3"].model, "qwen3-0.6b": WORKLOADS["W1"].model}


def projections(model: str) -> dict[str, tuple[int, tuple[int, ...]]]:
    """The projections LoRA wraps in ``model``, as the engine fuses them: name -> (in, the output
    size of each slice)."""
    from transformers import AutoConfig

    from pagedllm.lora.peft import expected_shapes

    shapes = expected_shapes(AutoConfig.from_pretrained(MODELS[model]))
    fused = {
        "qkv": ("q_proj", "k_proj", "v_proj"),
        "o": ("o_proj",),
        "gate_up": ("gate_proj", "up_proj"),
        "down": ("down_proj",),
    }
    return {name: (shapes[parts[0]][0], tuple(shapes[p][1] for p in parts)) for name, parts in fused.items()}


def _time_ms(fn: Any) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _first_call_ms(fn: Any) -> float:
    """One call's wall time, Triton's cache an empty directory: a variant this process has not
    launched yet compiles, as on a fresh machine."""
    import triton

    with tempfile.TemporaryDirectory(prefix="pagedllm-triton-") as cache, triton.knobs.cache.scope():
        triton.knobs.cache.dir = cache
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start)


def _tensors(
    in_features: int, sizes: tuple[int, ...], num_tokens: int, args: argparse.Namespace, seed: int
) -> tuple[torch.Tensor, ...]:
    """x, the base weight, the slots' A and B (``lora/layers.py``'s layout), bf16 on the GPU."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    out, width = sum(sizes), len(sizes) * args.num_slots * args.rank

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (scale * torch.randn(*shape, device=DEVICE, generator=gen)).bfloat16()

    x = randn(num_tokens, in_features, scale=1.0)
    weight = randn(out, in_features, scale=in_features**-0.5)
    return x, weight, randn(width, in_features, scale=0.01), randn(out, width, scale=0.01)


def _slice_starts(sizes: tuple[int, ...]) -> tuple[int, int]:
    """The first output row of slices 1 and 2 (the output size past the last)."""
    ends = list(itertools.accumulate(sizes))
    first, second = (ends[:-1] + [ends[-1]] * 2)[:2]
    return first, second


# name -> how LoRABatch runs it: (kernels, has_prefill); None: BGMV called directly.
PATHS = {"bgmv": None, "sgmv": (True, True), "decode": (True, False), "torch": (False, False)}


def _step(
    path: str, token_slots: np.ndarray, tensors: tuple[torch.Tensor, ...], sizes: tuple[int, ...], args: Any
) -> Any:
    """One call of ``path``'s product, ``y += ...`` on ``tensors`` (y, x, A, B), the step's slots
    set beforehand (SGMV's segments planned here, outside the timed calls, as the engine plans
    them once per step)."""
    from pagedllm.kernels.triton.lora import lora_shrink_expand
    from pagedllm.lora.punica import LoRABatch

    starts = _slice_starts(sizes)
    if PATHS[path] is None:
        slots = torch.from_numpy(token_slots).to(DEVICE)
        return functools.partial(lora_shrink_expand, *tensors, slots, args.num_slots, args.rank, starts)
    use_kernels, has_prefill = PATHS[path]
    batch = LoRABatch(
        args.num_slots, args.rank, len(token_slots), {len(sizes)}, torch.bfloat16, torch.device(DEVICE),
        use_kernels=use_kernels,
    )  # fmt: skip
    batch.set_token_slots(token_slots, has_prefill)
    return functools.partial(batch.apply, *tensors, len(sizes), starts)


def bench_size(shape: str, num_tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    hidden, sizes = projections(shape)["qkv"]
    out = sum(sizes)
    x, weight, lora_a, lora_b = _tensors(hidden, sizes, num_tokens, args, seed=num_tokens)
    rng = np.random.default_rng(num_tokens)
    token_slots = rng.integers(0, args.num_slots, num_tokens)
    token_slots[rng.random(num_tokens) < 0.25] = -1  # a quarter run without adapter
    y = x @ weight.T
    results = {
        path: _time_ms(_step(path, token_slots, (y, x, lora_a, lora_b), sizes, args)) for path in PATHS
    }
    base_ms = _time_ms(functools.partial(torch.matmul, x, weight.T))
    # Bytes of the adapters the batch reads: each distinct slot's A rows and B columns once.
    num_adapters = len({int(s) for s in token_slots if s >= 0})
    adapter_bytes = num_adapters * args.rank * (3 * hidden + out) * 2
    return {
        "shape": shape,
        "num_tokens": num_tokens,
        "num_adapters": num_adapters,
        "bgmv_ms": results["bgmv"],
        "sgmv_ms": results["sgmv"],
        "decode_ms": results["decode"],
        "torch_ms": results["torch"],
        "base_projection_ms": base_ms,
        "bgmv_adapter_gb_s": adapter_bytes / results["bgmv"] / 1e6,
    }


def w1_prefill_slots(num_tokens: int, num_slots: int) -> np.ndarray:
    """[num_tokens] a W1 prefill step's token slots: requests of 100 to 1024 tokens back to back,
    request i on slot i mod num_slots."""
    lengths = np.random.default_rng(0).integers(100, 1025, num_tokens // 100 + 1)
    return np.repeat(np.arange(len(lengths)) % num_slots, lengths)[:num_tokens]


def bench_prefill(args: argparse.Namespace) -> list[dict[str, Any]]:
    """SGMV and BGMV on each Qwen3-0.6B projection at a W1 prefill step: first call (a fresh
    compile) and median."""
    token_slots = w1_prefill_slots(args.prefill_tokens, args.num_slots)
    rows = []
    for name, (in_features, sizes) in projections("qwen3-0.6b").items():
        x, weight, lora_a, lora_b = _tensors(in_features, sizes, args.prefill_tokens, args, seed=len(rows))
        y = x @ weight.T
        row = {"projection": name, "in": in_features, "out": sum(sizes), "num_tokens": args.prefill_tokens}
        row["base_ms"] = _time_ms(functools.partial(torch.matmul, x, weight.T))
        for path in ("sgmv", "bgmv"):
            step = _step(path, token_slots, (y, x, lora_a, lora_b), sizes, args)
            row[f"{path}_first_ms"] = _first_call_ms(step)
            row[f"{path}_ms"] = _time_ms(step)
        rows.append(row)
    return rows


def format_prefill_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"Qwen3-0.6B prefill step, {rows[0]['num_tokens']} tokens: first call (fresh compile), median",
        "projection    in    out  base ms  sgmv first  sgmv ms  bgmv first  bgmv ms",
    ]
    for r in rows:
        lines.append(
            f"{r['projection']:8s}  {r['in']:5d}  {r['out']:5d}  {r['base_ms']:7.4f}  "
            f"{r['sgmv_first_ms']:10.1f}  {r['sgmv_ms']:7.4f}  "
            f"{r['bgmv_first_ms']:10.1f}  {r['bgmv_ms']:7.4f}"
        )
    return "\n".join(lines)


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "shape          tokens  adapters  bgmv ms  sgmv ms  decode ms  torch ms  bgmv/sgmv  base ms  "
        "bgmv GB/s (adapters)"
    ]
    for r in rows:
        lines.append(
            f"{r['shape']:13s}  {r['num_tokens']:6d}  {r['num_adapters']:8d}  {r['bgmv_ms']:7.4f}  "
            f"{r['sgmv_ms']:7.4f}  {r['decode_ms']:9.4f}  {r['torch_ms']:8.4f}  "
            f"{r['bgmv_ms'] / r['sgmv_ms']:9.2f}  {r['base_projection_ms']:7.4f}  "
            f"{r['bgmv_adapter_gb_s']:9.1f}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("pagedllm bench lora needs a CUDA device")
    # The prefill step first: its first calls are then the process's first compiles.
    prefill_rows = bench_prefill(args) if args.prefill_tokens else []
    rows = [bench_size(shape, n, args) for shape in args.shapes for n in args.num_tokens]
    report = {
        "device": torch.cuda.get_device_name(),
        "config": vars(args) | {"func": None},
        "prefill_rows": prefill_rows,
        "rows": rows,
    }
    if prefill_rows:
        print(format_prefill_table(prefill_rows))
    print(format_table(rows))
    write_json(args.output_json, report)
    return report
