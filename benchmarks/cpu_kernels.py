"""The CPU path's C++ kernels (pagedllm/kernels/cpu) against the PyTorch formulations they
replace, at C1's shapes (SmolLM2-135M: 9 query heads, 3 KV heads of 64, hidden 576, a vocabulary
of 49,152; bf16; blocks of 16).

    PYTHONPATH=. python benchmarks/cpu_kernels.py [--output-json F]

* attention: the ``cpu`` backend's forward (cache write included) with the kernel
  (``use_kernel``) and without, for a decode batch of 32 at contexts 100 and 400 and one stream's
  decode, their blocks scattered over 6,000 (``cold``: a 64 MB buffer written between calls, as a
  model step's weights evict the cache); then prefill chunks of 16 to 128 queries, fresh and behind
  200 cached tokens, and C1's prefill, with the kernel called on them directly against the
  backend's SDPA path (which chunks keep past ``KERNEL_CHUNK_MAX_CONTEXT``).
* rms_norm, rotary: one layer's call on a decode step's 32 rows and on C1's 1,164-token
  prefill. (A SiLU-and-multiply kernel measured no faster than PyTorch's two operators, 18
  against 19 us at 32 rows: not kept.)
* sampler's last pass: argmax + log-sum-exp of 32 rows against ``log_softmax`` + ``argmax``.

Wall-clock medians of 30 calls after 5 of warm-up, on whatever threads torch uses (start it as
``setsid -w sh -c 'echo -20 > /proc/self/autogroup; exec CMD'`` on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "attention"))

from test_cpu_backend import make_step  # noqa: E402  (the tests' step builder)

from pagedllm.attention.backends.cpu_backend import CpuAttentionBackend  # noqa: E402
from pagedllm.attention.metadata import AttentionMetadata  # noqa: E402
from pagedllm.kernels.cpu import ops  # noqa: E402
from pagedllm.layers.layernorm import RMSNorm  # noqa: E402
from pagedllm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

HEADS, KV_HEADS, HEAD_SIZE, BLOCK, HIDDEN, VOCAB = 9, 3, 64, 16, 576, 49152
DTYPE = torch.bfloat16
EVICT = torch.zeros(64 << 20, dtype=torch.uint8)


def median_us(fn: Callable[[], object], before: Callable[[], object] | None = None, calls: int = 30) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def decode_step(context_lens: list[int], num_blocks: int = 6000) -> tuple:
    """(q, k, v, caches, metadata) of a decode batch whose blocks lie scattered over a cache of a
    real engine's size (C1's engine profiles ~5,800 blocks)."""
    num_seqs = len(context_lens)
    seq_lens = torch.tensor([c + 1 for c in context_lens], dtype=torch.int32)
    width = -(-int(seq_lens.max()) // BLOCK)
    table = torch.randperm(num_blocks)[: num_seqs * width].view(num_seqs, width).int()
    caches = tuple(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_SIZE).to(DTYPE) for _ in range(2))
    slots = torch.tensor([int(table[i, c // BLOCK]) * BLOCK + c % BLOCK for i, c in enumerate(context_lens)])
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    md = AttentionMetadata(
        num_decodes=num_seqs,
        num_prefills=0,
        slot_mapping=slots,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=table,
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    q, k, v = (torch.randn(num_seqs, h, HEAD_SIZE).to(DTYPE) for h in (HEADS, KV_HEADS, KV_HEADS))
    return q, k, v, caches, md


def attention_case(step: tuple, cold: bool = False) -> dict:
    q, k, v, caches, md = step
    backend = CpuAttentionBackend(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS)
    result = {}
    for name, use_kernel in (("kernel", True), ("pytorch", False)):
        backend.use_kernel = use_kernel
        result[name] = median_us(
            lambda: backend.forward(q, k, v, caches, md), (lambda: EVICT.add_(1)) if cold else None
        )
    return result


def chunk_case(step: tuple) -> dict:
    """Prefill chunks: the kernel called on them directly against the backend's SDPA path (with
    the kernel off)."""
    q, k, v, caches, md = step
    backend = CpuAttentionBackend(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS)
    backend.use_kernel = False
    out = torch.empty_like(q)

    def kernel() -> None:
        ops.reshape_and_cache(k, v, *caches, md.slot_mapping)
        args = (md.block_tables, md.seq_lens_cpu, md.query_start_loc_cpu, HEAD_SIZE**-0.5)
        ops.paged_attention(out, q, *caches, *args)

    return {"kernel": median_us(kernel), "pytorch": median_us(lambda: backend.forward(q, k, v, caches, md))}


def norm_case(rows: int) -> dict:
    norm = RMSNorm(HIDDEN).to(DTYPE)
    x, residual = torch.randn(rows, HIDDEN).to(DTYPE), torch.randn(rows, HIDDEN).to(DTYPE)
    return {
        "kernel": median_us(lambda: norm.forward_cpu(x.clone(), residual.clone())),
        "pytorch": median_us(lambda: norm.forward_torch(x.clone(), residual.clone())),
    }


def rotary_case(rows: int) -> dict:
    rotary = RotaryEmbedding(HEAD_SIZE, 8192, {"rope_type": "default", "rope_theta": 100000.0}, DTYPE)
    positions = torch.randint(0, 500, (rows,))
    q = torch.randn(rows, HEADS * HEAD_SIZE).to(DTYPE)
    k = torch.randn(rows, KV_HEADS * HEAD_SIZE).to(DTYPE)
    return {
        "kernel": median_us(lambda: rotary.forward_cpu(positions, q.clone(), k.clone())),
        "pytorch": median_us(lambda: rotary.forward_torch(positions, q.clone(), k.clone())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    results: dict[str, dict] = {}
    cases = {
        "decode 32 x ctx 100": [100] * 32,
        "decode 32 x ctx 400": [400] * 32,
        "decode 1 x ctx 100": [100],
    }
    for name, context_lens in cases.items():
        step = decode_step(context_lens)
        for cold in (False, True):
            results[f"attention, {name}, {'cold' if cold else 'warm'}"] = attention_case(step, cold)
    for cached in (0, 200):
        for query_len in (16, 32, 48, 64, 128):
            step = make_step([cached], [query_len], HEADS, KV_HEADS, HEAD_SIZE, BLOCK, DTYPE)
            results[f"attention, {query_len} queries behind {cached}"] = chunk_case(step)
    step = make_step([0] * 32, [36] * 32, HEADS, KV_HEADS, HEAD_SIZE, BLOCK, DTYPE)
    results["attention, C1's prefill: 32 prompts of 36"] = chunk_case(step)

    for rows in (32, 1164):
        results[f"rms_norm + residual, {rows} rows"] = norm_case(rows)
        results[f"rotary, {rows} rows"] = rotary_case(rows)
    logits = torch.randn(32, VOCAB) * 4
    results["sampler's last pass, 32 rows"] = {
        "kernel": median_us(lambda: ops.argmax_logsumexp(logits)),
        "pytorch": median_us(lambda: (torch.log_softmax(logits, dim=-1), logits.argmax(dim=-1))),
    }

    print(f"{'case':48s} {'kernel us':>10s} {'pytorch us':>11s} {'speed-up':>9s}")
    for name, r in results.items():
        print(f"{name:48s} {r['kernel']:10.0f} {r['pytorch']:11.0f} {r['pytorch'] / r['kernel']:8.1f}x")
    if args.output_json:
        report = {"threads": torch.get_num_threads(), "results": results}
        Path(args.output_json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
