"""The decode kernel's own cache write (``paged_decode(append=...)``, decode_append.py) against the
two kernels it replaces: ``reshape_and_cache`` (rotating query and key) then ``paged_decode``.

Both paths must leave the same bits in the caches and write the same output: the rotation rounds
as rotary.py's does, and the attention reads the same keys. Random inputs over head sizes
(a padded one: 80), query heads per KV head, block sizes, partitions (one, several: the new token
in the last), dtypes, an FP8 cache, a sliding window, padding rows (slot -1), and no rotary.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.triton.paged_decode import paged_decode
from pagedllm.kernels.triton.reshape_and_cache import reshape_and_cache

CASES = [
    # (head_size, num_heads, num_kv_heads, block_size, partition_size, dtype, fp8, window, rotary)
    (64, 8, 2, 16, 64, torch.float32, False, None, True),
    (128, 4, 4, 16, 32, torch.float16, False, None, True),
    (80, 6, 2, 8, 32, torch.float32, False, None, True),
    (64, 4, 1, 32, 128, torch.bfloat16, False, None, True),
    (64, 8, 2, 16, 32, torch.float16, True, None, True),
    (64, 4, 2, 16, 32, torch.float32, False, 24, True),
    (64, 4, 2, 16, 32, torch.float32, False, None, False),
]


def _inputs(head_size, num_heads, num_kv_heads, block_size, dtype, fp8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.tensor([1, 37, 70, 5, 100, 16], dtype=torch.int32)
    num_seqs = seq_lens.numel()
    blocks_per_seq = -(-int(seq_lens.max()) // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    # Each sequence its own shuffled blocks.
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    block_tables = perm[: num_seqs * blocks_per_seq].view(num_seqs, blocks_per_seq).to(torch.int32)
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    key_cache = (torch.randn(shape, generator=gen) * 0.5).to(cache_dtype)
    value_cache = (torch.randn(shape, generator=gen) * 0.5).to(cache_dtype)
    # The new token's slot (its position seq_len - 1); the fourth row is padding (slot -1).
    positions = (seq_lens - 1).long()
    slots = (
        block_tables.long().gather(1, (positions // block_size)[:, None])[:, 0] * block_size
        + positions % block_size
    )
    slots[3] = -1
    query = torch.randn(num_seqs, num_heads, head_size, generator=gen).to(dtype)
    key = torch.randn(num_seqs, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_seqs, num_kv_heads, head_size, generator=gen).to(dtype)
    angles = torch.rand(512, head_size // 2, generator=gen) * 6.28
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)
    scales = (torch.tensor(0.7), torch.tensor(1.3)) if fp8 else (None, None)
    return (
        seq_lens,
        block_tables,
        key_cache,
        value_cache,
        slots,
        positions,
        query,
        key,
        value,
        cos_sin,
        scales,
    )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_append_in_decode_equals_the_cache_write_then_decode(case):
    head_size, num_heads, num_kv_heads, block_size, partition_size, dtype, fp8, window, rotary = case
    seq_lens, tables, key_cache, value_cache, slots, positions, query, key, value, cos_sin, scales = _inputs(
        head_size, num_heads, num_kv_heads, block_size, dtype, fp8
    )
    k_scale, v_scale = scales
    common = dict(
        sliding_window=window, k_scale=k_scale, v_scale=v_scale, partition_size=partition_size, block_n=16
    )
    max_seq_len = 128

    # The two kernels: rotate query (in place) and key into the cache, then attend.
    ref_query, ref_kc, ref_vc = query.clone(), key_cache.clone(), value_cache.clone()
    rotary_args = (ref_query, cos_sin, positions) if rotary else None
    reshape_and_cache(key, value, ref_kc, ref_vc, slots, rotary_args, (k_scale, v_scale) if fp8 else None)
    ref_out = torch.empty_like(query)
    paged_decode(ref_query, ref_kc, ref_vc, tables, seq_lens, 0.125, max_seq_len, ref_out, **common)

    # One kernel: the query stays unrotated in memory.
    fused_query, kc, vc = query.clone(), key_cache.clone(), value_cache.clone()
    out = torch.empty_like(query)
    append = (key, value, slots, (cos_sin, positions) if rotary else None)
    paged_decode(fused_query, kc, vc, tables, seq_lens, 0.125, max_seq_len, out, append=append, **common)

    assert torch.equal(fused_query, query)
    as_bits = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)
    assert torch.equal(as_bits(kc), as_bits(ref_kc)), "the key cache differs"
    assert torch.equal(as_bits(vc), as_bits(ref_vc)), "the value cache differs"
    # The padding row's slot is written by neither; its output is unused.
    real = torch.tensor([i != 3 for i in range(query.shape[0])])
    assert torch.equal(out[real], ref_out[real])
    # And the new tokens were really written: the caches moved at every real row's slot.
    assert not torch.equal(as_bits(kc), as_bits(key_cache))


def test_append_is_refused_with_query_groups_and_context_parallelism():
    seq_lens, tables, kc, vc, slots, positions, query, key, value, cos_sin, _ = _inputs(
        64, 4, 2, 16, torch.float32, False
    )
    out = torch.empty_like(query)
    append = (key, value, slots, (cos_sin, positions))
    groups = torch.ones_like(seq_lens)
    with pytest.raises(AssertionError, match="one query per sequence"):
        paged_decode(
            query, kc, vc, tables, seq_lens, 0.1, 128, out, query_lens=groups, max_query_len=2, append=append
        )
    with pytest.raises(AssertionError, match="KV heads"):
        paged_decode(
            query, kc, vc, tables, seq_lens, 0.1, 128, out, append=(key[:, :1], value[:, :1], slots, None)
        )
