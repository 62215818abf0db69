"""``pagedllm bench mla``: the MLA decode kernel (kernels/triton/mla_decode.py) against FlashInfer's
MLA decode (``flashinfer.mla.BatchMLAPagedAttentionWrapper``, the kernel vLLM and SGLang serve
DeepSeek with) in the same process: benchmarks/README.md's K1-MLA.

K1's method (``bench kernels``): a batch of 64 decodes at contexts 512, 4,096, 16,384 and ragged
[1, 8,192] (lengths from Python's ``random`` seeded as the workloads draw theirs); each kernel's
median device time over ``triton.testing.do_bench``'s CUDA-event timings after its warm-up,
replayed from a CUDA graph where the call can be captured; blocks shuffled in the cache. The
absorbed form's inputs at DeepSeek-V2-Lite's shape by default: 16 heads (``--num-heads 128`` for
V3's), latents of 512 + 64, block size 16, bf16. Both kernels read the same latents (FlashInfer
from its two caches, c_kv and k_pe, ours from the one ``[c_kv | k_pe]`` cache the engine keeps),
with the same block tables; FlashInfer's ``plan`` (host work) runs once per batch, as an engine
plans once per step, and its ``run`` is timed. Bandwidth counts the latents' bytes once.

Reports per context our time, FlashInfer's, their ratio (FlashInfer's time / ours: above 1 is
faster than FlashInfer), both bandwidths against a device copy of as many bytes, and the largest
difference between the two outputs. Without FlashInfer it says so in one line and times ours alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.entrypoints.bench import write_json
from pagedllm.entrypoints.bench.kernels import ContextRange, add_decode_batch_args

# (block_n, num_warps, num_stages) that --sweep tries (MLALaunch's fields; kept as tuples so that
# parsing the arguments imports no triton).
SWEEP = tuple(itertools.product((16, 32, 64), (4, 8), (1, 2, 3)))
# Tokens per partition that --sweep tries at the engine's launch, beside decode_partition_size's
# choice (the least the engine splits to is mla_decode.MLA_MIN_PARTITION).
SWEEP_PARTITIONS = (64, 128, 256, 512, 1024)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_decode_batch_args(parser)
    parser.add_argument("--num-heads", type=int, default=16, help="query heads (V2-Lite 16, V3 128)")
    parser.add_argument("--kv-lora-rank", type=int, default=512)
    parser.add_argument("--qk-rope-head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0, help="seeds the lengths and the random latents")
    parser.add_argument(
        "--sweep", action="store_true", help="also time every launch of SWEEP; report the best per context"
    )
    parser.add_argument("--output-json", help="write the report (every row) here")


def _inputs(seq_lens: tuple[int, ...], args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The absorbed query and a paged latent cache holding every sequence's context in shuffled
    blocks (with spare blocks, so no table is the identity)."""
    dtype, block_size = DTYPES[args.dtype], args.block_size
    gen = torch.Generator(device=device).manual_seed(args.seed)
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + 64
    order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device=device)
    for i, (first, n) in enumerate(zip(itertools.accumulate([0, *pages]), pages)):
        block_tables[i, :n] = order[first : first + n]
    width = args.kv_lora_rank + args.qk_rope_head_dim
    num_seqs, heads = len(seq_lens), args.num_heads
    return {
        "q_latent": torch.randn(num_seqs, heads, args.kv_lora_rank, generator=gen, device=device).to(dtype),
        "q_pe": torch.randn(num_seqs, heads, args.qk_rope_head_dim, generator=gen, device=device).to(dtype),
        "cache": torch.randn(num_blocks, block_size, width, generator=gen, device=device).to(dtype),
        "block_tables": block_tables,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "pages": pages,
    }


def _ours(
    inputs: dict[str, Any],
    scale: float,
    launch: tuple[int, int, int] | None = None,
    partition_size: int | None = None,
) -> tuple[Callable[[], object], torch.Tensor]:
    """The engine's call (eager: the batch's own longest and shortest context as the bounds), at
    ``launch``, an entry of SWEEP, and ``partition_size`` (None: the engine's choices)."""
    from pagedllm.kernels.triton.mla_decode import MLALaunch, mla_decode

    out = torch.empty_like(inputs["q_latent"])
    lens = inputs["seq_lens"].tolist()

    def call() -> None:
        mla_decode(
            inputs["q_latent"],
            inputs["q_pe"],
            inputs["cache"],
            inputs["block_tables"],
            inputs["seq_lens"],
            scale,
            max(lens),
            out,
            min_seq_len=min(lens),
            partition_size=partition_size,
            launch=None if launch is None else MLALaunch(*launch),
        )

    return call, out


def _flashinfer(inputs: dict[str, Any], scale: float) -> tuple[Callable[[], object], torch.Tensor]:
    """FlashInfer's MLA decode over its own caches (c_kv and k_pe apart, as it takes them), planned
    once for the batch."""
    import flashinfer

    q_latent, cache, pages = inputs["q_latent"], inputs["cache"], inputs["pages"]
    rank = q_latent.shape[2]
    device = q_latent.device
    ckv, kpe = cache[..., :rank].contiguous(), cache[..., rank:].contiguous()
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
        torch.empty(128 * 2**20, dtype=torch.uint8, device=device)
    )
    num_seqs = q_latent.shape[0]
    wrapper.plan(
        torch.arange(num_seqs + 1, dtype=torch.int32, device=device),  # one query per sequence
        torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32, device=device),
        torch.cat([inputs["block_tables"][i, :n] for i, n in enumerate(pages)]),
        inputs["seq_lens"],
        q_latent.shape[1],
        rank,
        kpe.shape[2],
        cache.shape[1],
        False,  # causal: a decode's query sees its whole context
        scale,
        q_latent.dtype,
        cache.dtype,
    )
    out = torch.empty_like(q_latent)
    return lambda: wrapper.run(q_latent, inputs["q_pe"], ckv, kpe, out=out), out


def _row(context: ContextRange, args: argparse.Namespace, has_flashinfer: bool) -> dict[str, Any]:
    from pagedllm.kernels.bench import _copy_ms, _gbps, _median_ms

    seq_lens = context.seq_lens(args.batch_size, args.seed)
    inputs = _inputs(seq_lens, args, torch.device("cuda"))
    # DeepSeek's scale: the head dims before absorption (nope 128 + rope 64).
    scale = (128 + args.qk_rope_head_dim) ** -0.5
    num_bytes = sum(seq_lens) * inputs["cache"].shape[2] * inputs["cache"].element_size()
    ours, our_out = _ours(inputs, scale)
    row: dict[str, Any] = {"context": context.label, "latent_bytes": num_bytes, "ours_ms": _median_ms(ours)}
    row["ours_gbps"] = _gbps(num_bytes, row["ours_ms"])
    row["copy_gbps"] = _gbps(2 * num_bytes, _copy_ms(num_bytes))
    if args.sweep:
        row.update(_sweep(inputs, scale))
    if has_flashinfer:
        try:
            theirs, their_out = _flashinfer(inputs, scale)
            row["flashinfer_ms"] = _median_ms(theirs)
        except (RuntimeError, ValueError) as e:  # a shape or build its installed version refuses
            print(f"FlashInfer's MLA decode failed at context {context.label}: {e}")
            row["flashinfer_error"] = str(e)
            return row
        row["flashinfer_gbps"] = _gbps(num_bytes, row["flashinfer_ms"])
        row["ratio"] = row["flashinfer_ms"] / row["ours_ms"]
        ours(), theirs()
        row["max_abs_diff"] = (our_out.float() - their_out.float()).abs().max().item()
    return row


def _sweep(inputs: dict[str, Any], scale: float) -> dict[str, Any]:
    """The fastest of ``SWEEP``'s launches (those past the device's registers or shared memory
    skipped) and of ``SWEEP_PARTITIONS`` at the engine's launch."""
    from triton.runtime.errors import OutOfResources

    from pagedllm.kernels.bench import _median_ms

    timings = {}
    for launch in SWEEP:
        try:
            timings[(launch, None)] = _median_ms(_ours(inputs, scale, launch)[0])
        except OutOfResources:
            continue
    for partition_size in SWEEP_PARTITIONS:
        timings[(None, partition_size)] = _median_ms(_ours(inputs, scale, None, partition_size)[0])
    (launch, partition_size), best_ms = min(timings.items(), key=lambda item: item[1])
    fields = ("block_n", "num_warps", "num_stages")
    best = {"partition_size": partition_size or "auto", **dict(zip(fields, launch or ("default",) * 3))}
    return {"best_ms": best_ms, "best_launch": best}


def main(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("pagedllm bench mla needs a CUDA device (and TRITON_INTERPRET unset)")
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    if not has_flashinfer:
        print(
            "FlashInfer is not installed (pip install flashinfer-python): timing the Triton MLA kernel alone"
        )
    rows = [_row(context, args, has_flashinfer) for context in args.contexts]
    print(
        f"MLA decode, batch {args.batch_size}, {args.num_heads} heads, latent {args.kv_lora_rank} + "
        f"{args.qk_rope_head_dim}, block {args.block_size}, {args.dtype} on {torch.cuda.get_device_name()}"
    )
    print(
        f"{'context':>10} {'ours us':>9} {'GB/s':>6} {'FI us':>9} {'GB/s':>6} {'FI/ours':>8} {'copy GB/s':>9}"
    )
    for r in rows:
        theirs = (
            f"{1e3 * r['flashinfer_ms']:9.1f} {r['flashinfer_gbps']:6.0f} {r['ratio']:7.3f}x"
            if "ratio" in r
            else f"{'-':>9} {'-':>6} {'-':>8}"
        )
        ours = f"{1e3 * r['ours_ms']:9.1f} {r['ours_gbps']:6.0f}"
        best = f"  best {1e3 * r['best_ms']:.1f} us at {r['best_launch']}" if "best_ms" in r else ""
        print(f"{r['context']:>10} {ours} {theirs} {r['copy_gbps']:9.0f}{best}")
    report = {
        "device": torch.cuda.get_device_name(),
        "flashinfer": has_flashinfer,
        "shape": {
            k: getattr(args, k) for k in ("batch_size", "num_heads", "kv_lora_rank", "block_size", "dtype")
        },
        "rows": rows,
    }
    write_json(args.output_json, report)
    return report
