"""One context-parallel rank's attention against the unsplit step: does P = 2 halve the time?

    PYTHONPATH=. python benchmarks/cp_attention.py                       # 16K and 64K, P = 1, 2
    PYTHONPATH=. python benchmarks/cp_attention.py --contexts 65536 --cp 1 2 4 --batch 8

Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head 128, bf16, 16-token blocks) on
one GPU, through the Triton backend as the engine launches it. Per context length N:

* decode: ``--batch`` sequences of N tokens each decode one token; P = 1 is ``forward`` over the
  whole context, P > 1 is rank 0's ``forward_partial`` over its ``ceil(N / P)`` striped keys (the
  merge across ranks, a few [tokens, heads] tensors, is not included).
* prefill: one chunk of ``--chunk`` tokens that ends the N-token context (a chunked prefill's last
  chunk, the costliest), same split.

Times are ``triton.testing.do_bench``'s median (ms). Decode reports the K/V bytes read per second
(GB/s: ``2 * keys * num_kv_heads * head_size * 2`` bytes), prefill the attention TFLOP/s
(``4 * num_heads * head_size`` FLOPs per visible (query, key) pair). Prints one JSON line per
(phase, N, P) with the speedup over P = 1.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from pagedllm.attention.backends.triton_backend import TritonAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def rank_step(
    context_lens: list[int], query_lens: list[int], cp_rank: int, cp_world_size: int
) -> tuple[tuple[torch.Tensor, ...], AttentionMetadata]:
    """((query, key, value, key_cache, value_cache), metadata) of rank cp_rank: random K/V, each
    sequence's local blocks contiguous, the metadata global."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    local = [-(-(n - cp_rank) // cp_world_size) for n in seq_lens]
    blocks = [-(-n // BLOCK_SIZE) for n in local]
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    for i, n in enumerate(blocks):
        table[i, :n] = torch.arange(sum(blocks[:i]), sum(blocks[:i]) + n)
    slots = []
    for i, (ctx, n) in enumerate(zip(context_lens, seq_lens)):
        pos = torch.arange(ctx, n)
        j = pos // cp_world_size
        slot = table[i, j // BLOCK_SIZE].long() * BLOCK_SIZE + j % BLOCK_SIZE
        slots.append(torch.where(pos % cp_world_size == cp_rank, slot, -1))
    # The step's index tensors, on the host (the _cpu copies) and the device.
    host = {
        "slot_mapping": torch.cat(slots),
        "query_start_loc": torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "block_tables": table,
    }
    cuda = torch.device("cuda")
    md = AttentionMetadata(
        num_decodes=sum(q == 1 for q in query_lens),
        num_prefills=sum(q > 1 for q in query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=host["query_start_loc"],
        seq_lens_cpu=host["seq_lens"],
        **{name: tensor.to(cuda) for name, tensor in host.items()},
    )
    num_tokens = sum(query_lens)
    cache_shape = (sum(blocks), NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
    tensors = (
        torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, dtype=DTYPE, device=cuda),
        torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, dtype=DTYPE, device=cuda),
        torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, dtype=DTYPE, device=cuda),
        torch.randn(cache_shape, dtype=DTYPE, device=cuda),
        torch.randn(cache_shape, dtype=DTYPE, device=cuda),
    )
    return tensors, md


def time_rank(context_lens: list[int], query_lens: list[int], cp_world_size: int) -> float:
    """Median ms of rank 0's attention step (forward at P = 1, forward_partial above)."""
    (query, key, value, key_cache, value_cache), md = rank_step(context_lens, query_lens, 0, cp_world_size)
    layer = TritonAttentionBackend(
        NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, NUM_KV_HEADS, cp_rank=0, cp_world_size=cp_world_size
    )
    step = layer.forward if cp_world_size == 1 else layer.forward_partial
    return triton.testing.do_bench(lambda: step(query, key, value, (key_cache, value_cache), md))


def rank0_pairs(context_len: int, query_len: int, cp_world_size: int) -> int:
    """(query, key) pairs rank 0 scores for a chunk of query_len ending a context_len context."""
    first = context_len - query_len
    return sum(p // cp_world_size + 1 for p in range(first, context_len))


def main(contexts: list[int], cp_sizes: list[int], batch: int, chunk: int) -> None:
    for n in contexts:
        for phase in ("decode", "prefill"):
            base = None
            for p in cp_sizes:
                if phase == "decode":
                    ms = time_rank([n - 1] * batch, [1] * batch, p)
                    keys = batch * -(-n // p)
                    rate = {"GB/s": round(2 * keys * NUM_KV_HEADS * HEAD_SIZE * 2 / ms / 1e6, 1)}
                else:
                    ms = time_rank([n - chunk], [chunk], p)
                    flops = 4 * NUM_HEADS * HEAD_SIZE * rank0_pairs(n, chunk, p)
                    rate = {"TFLOP/s": round(flops / ms / 1e9, 1)}
                base = base or ms
                row = {"phase": phase, "context": n, "cp": p, "ms": round(ms, 3), **rate}
                print(json.dumps({**row, "vs_cp1": round(ms / base, 3)}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2], help="P values; the first is the base")
    parser.add_argument("--batch", type=int, default=1, help="decode sequences")
    parser.add_argument("--chunk", type=int, default=8192, help="prefill chunk tokens")
    args = parser.parse_args()
    main(args.contexts, args.cp, args.batch, args.chunk)
