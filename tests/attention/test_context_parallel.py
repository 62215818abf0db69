"""Context parallelism's attention, in one process: P ranks' partials over a striped cache,
merged by their log-sum-exps, equal the attention of one rank over the whole cache.

Each step mixes decodes and prefill chunks behind cached contexts (some shorter than P, so that
a rank holds none of a sequence's keys), GQA, and the variants keys meet by their position (a
sliding window, ALiBi, a soft cap). Caches start as NaN: a rank reading a slot it does not own
fails loudly. The striping is the engine's own (``compute_slot_mapping``), the oracle the torch
backend over an unsplit cache."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.attention.context_parallel import merge_partials
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.worker.step_inputs import compute_slot_mapping

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 16, 4
# (cached tokens, new tokens) per sequence, decodes first.
STEP = [(0, 1), (1, 1), (9, 1), (30, 1), (0, 7), (5, 3), (17, 12), (2, 1 + 0)]
VARIANTS = {
    "plain": {},
    "window": {"sliding_window": 5},
    "alibi": {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])},
    "softcap": {"logits_soft_cap": 2.0},
}


def run_step(
    step: list[tuple[int, int]], rank: int, size: int, variants: dict, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's forward_partial (or forward, with size 1) over the step; the same random
    tokens for every rank (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    step = sorted(step, key=lambda s: s[1] != 1)
    lens = [c + q for c, q in step]
    # The tokens first, the same draws whatever the rank count; then the block table.
    drawn = [
        (
            torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen),
            torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen),
            torch.randn(q, NUM_HEADS, HEAD_SIZE, generator=gen),
        )
        for n, (_, q) in zip(lens, step)
    ]
    tokens_per_block = BLOCK_SIZE * size
    blocks = [-(-n // tokens_per_block) for n in lens]
    table = torch.zeros(len(step), max(blocks), dtype=torch.int32)
    ids = torch.randperm(sum(blocks) + 1, generator=gen)
    for i, n in enumerate(blocks):
        table[i, :n] = ids[sum(blocks[:i]) : sum(blocks[: i + 1])]
    caches = tuple(
        torch.full((sum(blocks) + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), float("nan")) for _ in range(2)
    )
    queries, keys, values, slots = [], [], [], []
    for i, (ctx, _) in enumerate(step):
        k, v, query = drawn[i]
        queries.append(query)
        seq_slots = torch.from_numpy(
            compute_slot_mapping(table[i].numpy(), np.arange(lens[i]), BLOCK_SIZE, (rank, size))
        )
        cached = seq_slots[:ctx]
        for cache, x in zip(caches, (k, v)):
            cache.view(-1, NUM_KV_HEADS, HEAD_SIZE)[cached[cached >= 0]] = x[:ctx][cached >= 0]
        keys.append(k[ctx:])
        values.append(v[ctx:])
        slots.append(seq_slots[ctx:])
    query_lens = [q for _, q in step]
    num_decodes = sum(q == 1 for q in query_lens)
    md = AttentionMetadata(
        num_decodes=num_decodes,
        num_prefills=len(step) - num_decodes,
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=table,
        max_query_len=max(query_lens),
        max_seq_len=max(lens),
        query_start_loc_cpu=torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32),
        seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
    )
    backend = TorchAttentionBackend(
        NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, NUM_KV_HEADS, cp_rank=rank, cp_world_size=size, **variants
    )
    args = (torch.cat(queries), torch.cat(keys), torch.cat(values), caches, md)
    if size == 1:
        return backend.forward(*args), None
    return backend.forward_partial(*args)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("size", [2, 3])
def test_merged_partials_equal_attention_over_the_whole_cache(size, variant):
    expected, _ = run_step(STEP, 0, 1, VARIANTS[variant])
    partials = [run_step(STEP, rank, size, VARIANTS[variant]) for rank in range(size)]
    for out, lse in partials:
        assert out.shape == expected.shape and lse.shape == expected.shape[:2] and lse.dtype == torch.float32
        assert not out.isnan().any() and not lse.isnan().any()
    outs = torch.stack([out for out, _ in partials])
    lses = torch.stack([lse for _, lse in partials])
    torch.testing.assert_close(merge_partials(outs, lses), expected, atol=1e-5, rtol=1e-5)


def test_a_rank_holding_no_key_of_a_query_gives_zero_and_minus_infinity():
    """The first token of a sequence (position 0) lives on rank 0: rank 1 sees nothing for it."""
    out, lse = run_step([(0, 1)], 1, 2, {})
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())
    out, lse = run_step([(0, 1)], 0, 2, {})
    assert bool(lse.isfinite().all())


def test_partial_log_sum_exp_is_that_of_the_rank_keys():
    """lse against its definition: log of the sum of exp(scaled score) over the visible keys,
    here a decode at position 9 whose rank-1 keys are positions 1, 3, 5, 7, 9."""
    gen = torch.Generator().manual_seed(0)  # run_step's seed
    step = [(9, 1)]
    _, lse = run_step(step, 1, 2, {})
    # The same random draws run_step made, in its order.
    k = torch.randn(10, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    torch.randn(10, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    q = torch.randn(1, NUM_HEADS, HEAD_SIZE, generator=gen)
    keys = k[1::2].repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)  # [5, heads, dim]
    scores = torch.einsum("hd,khd->hk", q[0].double(), keys.double()) * HEAD_SIZE**-0.5
    torch.testing.assert_close(lse[0].double(), torch.logsumexp(scores, dim=-1), atol=1e-5, rtol=1e-6)
