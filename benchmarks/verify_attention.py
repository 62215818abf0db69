"""The decode attention of a verify step: k + 1 tokens per request, with and without query groups.

A request verifying k drafts arrives at attention as k + 1 decode sequences over the same context
(batch expansion). Without query groups each of them reads the whole context; with them
(``paged_decode``'s ``query_lens``) one program per KV head and partition reads it once for all
k + 1 tokens. Per batch size and context range, timed in CUDA graphs (medians of replays, after
a warm-up run), at the launch parameters the Triton backend uses:

- ``decode``: B sequences of one token (the step without drafts);
- ``expanded``: B * (k + 1) sequences, one program each (what verify steps ran before groups);
- ``grouped``: the same sequences in groups of k + 1.

Prints a table of microseconds and the ratios to ``decode``; ``--output-json`` writes the rows.
Needs a CUDA device. Shapes default to Llama-3.1-8B's (32 query / 8 KV heads of 128, bf16).

    python benchmarks/verify_attention.py --batch-sizes 1 16 64 256 --contexts 100-1280 4096
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict

import torch

from pagedllm.kernels.bench import DecodeInputs, DecodeShape, graph_median_us
from pagedllm.kernels.triton import paged_decode
from pagedllm.kernels.triton.launch import decode_partition_size, default_launches

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def expand(inputs: DecodeInputs, group: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Each request's last ``group`` tokens as sequences of their own: (query, block_tables,
    seq_lens, query_lens) over the request's cache."""
    device = inputs.query.device
    lens = inputs.seq_lens.repeat_interleave(group) - torch.arange(group - 1, -1, -1, device=device).repeat(
        len(inputs.seq_lens)
    )
    query_lens = torch.zeros(len(lens), dtype=torch.int32, device=device)
    query_lens[group - 1 :: group] = group
    gen = torch.Generator(device=device).manual_seed(seed)
    query = torch.randn(
        len(lens), *inputs.query.shape[1:], generator=gen, device=device, dtype=inputs.query.dtype
    )
    return query, inputs.block_tables.repeat_interleave(group, 0), lens.to(torch.int32), query_lens


def time_case(
    args: argparse.Namespace, batch_size: int, lo: int, hi: int, device: torch.device
) -> dict[str, float]:
    rng = random.Random(args.seed)
    group = args.num_speculative_tokens + 1
    # Contexts after the step: at least the group's tokens.
    seq_lens = tuple(max(rng.randint(lo, hi), group) for _ in range(batch_size))
    dtype = DTYPES[args.dtype]
    shape = DecodeShape(seq_lens, args.num_heads, args.num_kv_heads, args.head_size, args.block_size, dtype)
    inputs = DecodeInputs.random(shape, device, args.seed)
    query, tables, lens, query_lens = expand(inputs, group, args.seed + 1)
    launch = default_launches(args.head_size, dtype)[0]
    scale = args.head_size**-0.5
    max_seq_len = args.max_model_len

    def call(q, bt, sl, programs, **groups):
        """One launch as triton_backend.triton_decode makes it: partitions sized for ``programs``
        (sequence, KV head) pairs that attend, the bound a graph is captured with."""
        out = torch.empty_like(q)
        partition = decode_partition_size(programs, args.num_kv_heads, max_seq_len, asdict(launch), device)
        kwargs = {**asdict(launch), "partition_size": partition, **groups}
        return lambda: paged_decode(
            q, inputs.key_cache, inputs.value_cache, bt, sl, scale, max_seq_len, out, **kwargs
        )

    calls = {
        "decode": call(inputs.query, inputs.block_tables, inputs.seq_lens, batch_size),
        "expanded": call(query, tables, lens, len(lens)),
        "grouped": call(query, tables, lens, batch_size, query_lens=query_lens, max_query_len=group),
    }
    return {name: graph_median_us([fn], repeats=args.repeats) for name, fn in calls.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument(
        "--contexts", nargs="+", default=["100-1280", "4096"], help="LEN or LO-HI per request"
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=8192, help="the graphs' bound, as the engine's")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("verify_attention: needs a CUDA device")
    rows = []
    header = ("batch", "context", "decode us", "expanded", "grouped", "exp/dec", "grp/dec")
    print(" ".join(f"{h:>10}" for h in header))
    for context in args.contexts:
        lo, _, hi = context.partition("-")
        for batch_size in args.batch_sizes:
            t = time_case(args, batch_size, int(lo), int(hi or lo), torch.device("cuda"))
            row = {"batch_size": batch_size, "context": context, **t}
            rows.append(row)
            cells = (batch_size, context, *(f"{t[k]:.1f}" for k in t))
            ratios = (f"{t['expanded'] / t['decode']:.2f}", f"{t['grouped'] / t['decode']:.2f}")
            print(" ".join(f"{c:>10}" for c in (*cells, *ratios)))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {"config": vars(args), "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
