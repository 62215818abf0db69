"""A fresh prompt's attention on the CPU: the C++ paged kernel against causal SDPA.

    PYTHONPATH=. python benchmarks/cpu_prefill_attention.py [--threads 2] [--output-json F]

One layer of SmolLM2-135M (9 query heads, 3 KV heads of 64), bf16, prompts of 32 to 2,048 tokens
with no cached prefix: the kernel (kernels/cpu/csrc/paged_attention.cpp: each token walks its keys
in the paged cache with an online softmax) and ``F.scaled_dot_product_attention(is_causal=True,
enable_gqa=True)`` over the chunk's own keys, which the CPU backend takes from
``SDPA_CAUSAL_MIN_TOKENS`` tokens (attention/backends/cpu_backend.py). Medians of 9 calls after one
warm-up, in milliseconds; the two outputs' largest difference beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.kernels.cpu.ops import paged_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 16
LENGTHS = (32, 64, 128, 256, 512, 1000, 2048)


def median_ms(fn, repeats: int = 9) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(length: int) -> dict:
    gen = torch.Generator().manual_seed(length)
    q, k, v = (
        torch.randn(length, heads, HEAD_SIZE, generator=gen).bfloat16()
        for heads in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)
    )
    scale = HEAD_SIZE**-0.5
    num_blocks = -(-length // BLOCK_SIZE)
    key_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    key_cache.view(-1, NUM_KV_HEADS, HEAD_SIZE)[:length] = k
    value_cache.view(-1, NUM_KV_HEADS, HEAD_SIZE)[:length] = v
    block_table = torch.arange(num_blocks, dtype=torch.int32)[None]
    seq_lens = torch.tensor([length], dtype=torch.int32)
    query_start_loc = torch.tensor([0, length], dtype=torch.int32)
    kernel_out = torch.empty_like(q)

    def kernel() -> None:
        paged_attention(
            kernel_out,
            q,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            query_start_loc,
            scale,
            None,
            None,
            None,
        )

    def sdpa() -> torch.Tensor:
        heads_first = (t.transpose(0, 1)[None] for t in (q, k, v))
        return F.scaled_dot_product_attention(*heads_first, is_causal=True, scale=scale, enable_gqa=True)

    kernel_ms, sdpa_ms = median_ms(kernel), median_ms(sdpa)
    difference = (kernel_out.float() - sdpa()[0].transpose(0, 1).float()).abs().max().item()
    return {"tokens": length, "kernel_ms": kernel_ms, "sdpa_ms": sdpa_ms, "max_abs_difference": difference}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for length in LENGTHS:
        row = measure(length)
        rows.append(row)
        print(
            f"{length:>5} tokens: kernel {row['kernel_ms']:8.2f} ms, causal SDPA {row['sdpa_ms']:8.2f} ms "
            f"({row['kernel_ms'] / row['sdpa_ms']:.2f}x), largest difference {row['max_abs_difference']:.3g}",
            flush=True,
        )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
