"""Run each CUDA kernel once on a tiny case, for compute-sanitizer to watch.

    python -c "from pagedllm.kernels.cuda.build import load; load()"   # build outside the sanitizer
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python scripts/cuda_sanitize.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python scripts/cuda_sanitize.py

PYTORCH_NO_CUDA_MEMORY_CACHING=1 gives every tensor its own allocation, so memcheck sees a read
one element past a tensor instead of landing in the caching allocator's neighbouring block.

The case covers each code path once: reshape_and_cache with a padding slot; V1 and V2 (with its
reduce) over GQA, a last block cut mid-way whose unused slots are NaN, a sequence of one token, a
host bound above every length (V2 partitions that exit at once), with and without ALiBi; every
dtype at block sizes 8 and 32 (thread groups of 4 and of 1) and 16 in bfloat16. Exits non-zero
if an output differs from the torch backend's.
"""

from __future__ import annotations

import sys

import torch

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.cuda import paged_attention_v1, paged_attention_v2, reshape_and_cache
from pagedllm.kernels.cuda.layout import kv_cache_shape, reshape_and_cache_reference, to_triton_layout

DEVICE = torch.device("cuda")
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 64
SEQ_LENS = [1, 37, 600]  # 600: two V2 partitions, the second cut mid-block


def run_case(dtype: torch.dtype, block_size: int) -> float:
    """Largest |kernel - torch| over V1 and V2, with and without ALiBi (0 slopes: same oracle);
    inf if the cache write differs from the reference."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    num_tokens = sum(SEQ_LENS)
    blocks_per_seq = [-(-n // block_size) for n in SEQ_LENS]
    num_blocks = sum(blocks_per_seq) + 1
    block_tables = torch.zeros(len(SEQ_LENS), max(blocks_per_seq), dtype=torch.int32, device=DEVICE)
    slots, first = [], 0
    for i, (n, seq_len) in enumerate(zip(blocks_per_seq, SEQ_LENS)):
        block_tables[i, :n] = torch.arange(first, first + n, dtype=torch.int32, device=DEVICE)
        slots.append(first * block_size + torch.arange(seq_len, device=DEVICE))
        first += n
    # Every token of every context written this step, plus one padding token (slot -1).
    slot_mapping = torch.cat([*slots, torch.tensor([-1], device=DEVICE)])
    key, value = (
        torch.randn(num_tokens + 1, NUM_KV_HEADS, HEAD_SIZE, generator=gen, device=DEVICE).to(dtype)
        for _ in range(2)
    )
    shapes = kv_cache_shape(num_blocks, block_size, NUM_KV_HEADS, HEAD_SIZE, dtype)
    caches = [torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for shape in shapes]
    reshape_and_cache(key, value, *caches, slot_mapping)
    expected = [torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for shape in shapes]
    reshape_and_cache_reference(key, value, *expected, slot_mapping)
    # Exactly the reference's cache, NaN (never written) in the same places.
    same = all(
        torch.equal(c.isnan(), e.isnan()) and torch.equal(c[~c.isnan()], e[~e.isnan()])
        for c, e in zip(caches, expected)
    )
    error = 0.0 if same else float("inf")

    query = torch.randn(len(SEQ_LENS), NUM_HEADS, HEAD_SIZE, generator=gen, device=DEVICE).to(dtype)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=DEVICE)
    scale = HEAD_SIZE**-0.5
    ref = oracle(query, caches, block_tables, seq_lens, scale)
    zero_slopes = torch.zeros(NUM_HEADS, dtype=torch.float32, device=DEVICE)
    for kernel in (paged_attention_v1, paged_attention_v2):
        for slopes in (None, zero_slopes):
            out = torch.full_like(query, float("nan"))
            kernel(query, *caches, block_tables, seq_lens, scale, 1100, out, slopes)
            error = max(error, float((out.float() - ref.float()).abs().max()))
    return error


def oracle(
    query: torch.Tensor,
    caches: list[torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The torch backend on the same cached tokens (a decode batch that writes nothing)."""
    num_seqs = query.shape[0]
    torch_caches = tuple(c.transpose(1, 2).contiguous() for c in to_triton_layout(*caches))
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    md = AttentionMetadata(
        num_decodes=num_seqs,
        num_prefills=0,
        slot_mapping=torch.full((num_seqs,), -1, device=DEVICE),
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=seq_lens,
        block_tables=block_tables,
        max_query_len=1,
        max_seq_len=max(SEQ_LENS),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens.cpu(),
    )
    kv = torch.zeros(num_seqs, NUM_KV_HEADS, HEAD_SIZE, dtype=query.dtype, device=DEVICE)
    backend = TorchAttentionBackend(NUM_HEADS, HEAD_SIZE, scale, NUM_KV_HEADS)
    return backend.forward(query, kv, kv, torch_caches, md)


def main() -> int:
    cases = [
        (dtype, block_size)
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
        for block_size in (8, 32)
    ]
    cases.append((torch.bfloat16, 16))
    failed = False
    for dtype, block_size in cases:
        error = run_case(dtype, block_size)
        ok = error <= (1e-4 if dtype == torch.float32 else 2e-2)
        failed |= not ok
        print(f"{dtype} block {block_size}: max error {error:.2e} {'ok' if ok else 'FAILED'}")
    torch.cuda.synchronize()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
