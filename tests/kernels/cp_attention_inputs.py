"""Context-parallel attention inputs for the kernel tests: one step's sequences, each rank's stripe
of their K/V in a paged cache, a naive reference of a rank's partial attention, and the
log-sum-exp merge of the ranks' partials.

Striping (the contract of ``PagedAttentionBackend.forward_partial``): of ``P`` ranks, rank ``r``
holds the token at global position ``t`` iff ``t % P == r``, at local index ``t // P`` of the
sequence's blocks. The metadata stays global (seq_lens, query_start_loc); only the block tables,
the caches and the slot mapping (-1 where another rank stores the token) are the rank's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.attention.metadata import AttentionMetadata

# Where the kernel tests run: on the CPU under Triton's interpreter (tests/kernels/conftest.py sets
# it without a GPU), else on CUDA.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")


@dataclass
class Sequences:
    """One step's sequences in float32 on the host: sequence i has context_lens[i] cached tokens
    and query_lens[i] new ones (the first num_decodes have one)."""

    context_lens: list[int]
    query_lens: list[int]
    num_decodes: int
    query: torch.Tensor  # [num_tokens, num_heads, head_size], the new tokens' queries
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_size], every position
    values: list[torch.Tensor]

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]

    def rounded(self, dtype: torch.dtype) -> Sequences:
        """The sequences as tensors of ``dtype`` hold them (the reference's inputs), in float32."""

        def r(x: torch.Tensor) -> torch.Tensor:
            return x.to(dtype).float()

        keys, values = [r(k) for k in self.keys], [r(v) for v in self.values]
        return Sequences(self.context_lens, self.query_lens, self.num_decodes, r(self.query), keys, values)

    def new_tokens(self, kv: list[torch.Tensor]) -> torch.Tensor:
        """The step's new tokens' rows of ``keys`` or ``values``, concatenated."""
        return torch.cat([x[c:] for x, c in zip(kv, self.context_lens)])


def make_sequences(
    num_decodes: int,
    context_lens: list[int],
    query_lens: list[int],
    shape: tuple[int, int, int],
    seed: int = 0,
) -> Sequences:
    """Random sequences; shape = (num_heads, num_kv_heads, head_size)."""
    assert all(q == 1 for q in query_lens[:num_decodes])
    num_heads, num_kv_heads, head_size = shape
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=gen)
    keys = [torch.randn(n, num_kv_heads, head_size, generator=gen) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_size, generator=gen) for n in seq_lens]
    return Sequences(context_lens, query_lens, num_decodes, query, keys, values)


@dataclass
class RankStep:
    """One rank's inputs to forward/forward_partial: the cache holds the rank's stripe of every
    context (NaN in every slot no sequence uses); key/value are all the step's new tokens."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, num_kv_heads, block_size, head_size]
    md: AttentionMetadata


def local_count(num_global: int, cp_rank: int, cp_world_size: int) -> int:
    """How many of the global positions [0, num_global) rank cp_rank holds."""
    return max(0, -(-(num_global - cp_rank) // cp_world_size))


def rank_step(
    seqs: Sequences,
    cp_rank: int,
    cp_world_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_padding_tokens: int = 0,
    cache_dtype: torch.dtype | None = None,
) -> RankStep:
    """Rank cp_rank's step (cp_world_size 1: the unsplit one): query, key and value in dtype, the
    caches in cache_dtype (default dtype). Physical blocks are shuffled."""
    cache_dtype = cache_dtype or dtype
    num_kv_heads, head_size = seqs.keys[0].shape[1:]
    local_lens = torch.tensor([local_count(n, cp_rank, cp_world_size) for n in seqs.seq_lens])
    blocks_per_seq = -(-local_lens // block_size)
    num_blocks = int(blocks_per_seq.sum()) + 2
    # Row i's first blocks_per_seq[i] entries (row-major, so in order) get a shuffled set of blocks.
    block_tables = torch.zeros(len(local_lens), int(blocks_per_seq.max()) + 1, dtype=torch.int32)
    owned = torch.arange(block_tables.shape[1])[None, :] < blocks_per_seq[:, None]
    shuffled = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(cp_rank))
    block_tables[owned] = shuffled[: int(blocks_per_seq.sum())].int()

    def slots(i: int, positions: range) -> torch.Tensor:
        """The cache slots of global positions of sequence i; -1 where another rank holds one."""
        pos = torch.tensor(list(positions), dtype=torch.int64)
        j = pos // cp_world_size  # the local index, were the token this rank's
        slot = block_tables[i, j // block_size].long() * block_size + j % block_size
        return torch.where(pos % cp_world_size == cp_rank, slot, -1)

    shape = (num_blocks, num_kv_heads, block_size, head_size)
    caches = tuple(torch.full(shape, float("nan")).to(cache_dtype) for _ in range(2))
    for i, ctx in enumerate(seqs.context_lens):
        context = slots(i, range(ctx))
        mine = context >= 0
        for cache, kv in zip(caches, (seqs.keys, seqs.values)):
            s = context[mine]
            cache[s // block_size, :, s % block_size] = kv[i][:ctx][mine].to(cache_dtype)
    lens = zip(seqs.context_lens, seqs.seq_lens)
    new_slots = torch.cat([slots(i, range(ctx, n)) for i, (ctx, n) in enumerate(lens)])
    slot_mapping = torch.cat([new_slots, torch.full((num_padding_tokens,), -1, dtype=torch.int64)])
    query_start_loc = torch.tensor([0, *torch.tensor(seqs.query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(seqs.seq_lens, dtype=torch.int32)
    md = AttentionMetadata(
        num_decodes=seqs.num_decodes,
        num_prefills=len(seq_lens) - seqs.num_decodes,
        slot_mapping=slot_mapping.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        block_tables=block_tables.to(device),
        max_query_len=max(seqs.query_lens),
        max_seq_len=max(seqs.seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )

    def padded(x: torch.Tensor) -> torch.Tensor:
        pad = x.new_zeros(num_padding_tokens, *x.shape[1:])
        return torch.cat([x, pad]).to(dtype).to(device)

    key, value = seqs.new_tokens(seqs.keys), seqs.new_tokens(seqs.values)
    kv_cache = (caches[0].to(device), caches[1].to(device))
    return RankStep(padded(seqs.query), padded(key), padded(value), kv_cache, md)


def reference_partial(
    seqs: Sequences, stripe: tuple[int, int], scale: float, **variants: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [num_tokens, num_heads, head_size], lse [num_tokens, num_heads]) in float64: each query
    over the keys of rank ``stripe = (cp_rank, cp_world_size)`` it sees, by the mask of global
    positions; out 0 and lse -inf where it sees none. variants: the backends' sliding_window,
    alibi_slopes, logits_soft_cap. The inputs are taken as they are (``Sequences.rounded`` first)."""
    cp_rank, cp_world_size = stripe
    sliding_window = variants.pop("sliding_window", None)
    alibi_slopes = variants.pop("alibi_slopes", None)
    logits_soft_cap = variants.pop("logits_soft_cap", None)
    assert not variants, f"no reference for {sorted(variants)}"
    num_heads = seqs.query.shape[1]
    group = num_heads // seqs.keys[0].shape[1]
    outs, lses = [], []
    token = 0
    for i, (ctx, seq_len) in enumerate(zip(seqs.context_lens, seqs.seq_lens)):
        key_pos = torch.tensor(list(range(cp_rank, seq_len, cp_world_size)), dtype=torch.int64)
        k = seqs.keys[i][key_pos].double().repeat_interleave(group, dim=1)  # [n, num_heads, d]
        v = seqs.values[i][key_pos].double().repeat_interleave(group, dim=1)
        for pos in range(ctx, seq_len):
            q = seqs.query[token].double()  # [num_heads, d]
            token += 1
            s = torch.einsum("hd,nhd->hn", q, k) * scale
            if logits_soft_cap is not None:
                s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
            if alibi_slopes is not None:
                s = s + alibi_slopes.double().cpu()[:, None] * (key_pos - pos).double()[None, :]
            visible = key_pos <= pos
            if sliding_window is not None:
                visible &= key_pos > pos - sliding_window
            s = s.masked_fill(~visible[None, :], float("-inf"))
            lse = torch.logsumexp(s, dim=1)  # -inf where no key is visible
            p = torch.exp(s - torch.where(lse.isinf(), 0.0, lse)[:, None])
            outs.append(torch.einsum("hn,nhd->hd", p, v))
            lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks' partial attentions merged by log-sum-exp, in float64: out = sum_r w_r out_r with
    w_r = exp(lse_r - lse), lse = log sum_r exp(lse_r)."""
    lse = torch.logsumexp(torch.stack([x.double() for x in lses]), dim=0)
    out = sum(torch.exp(part_lse.double() - lse)[..., None] * o.double() for o, part_lse in zip(outs, lses))
    return out, lse
