"""The CPU attention backend against the torch oracle, and its score options against the formula,
through both of its paths: the C++ kernel for decodes (prefill chunks by SDPA) and the PyTorch
formulation it falls back to.

Batches mix decodes and prefill chunks (some behind a cached prefix, some longer than the
longer ones), with shuffled physical blocks, tails ending mid-block, GQA ratios 1..4, padding
tokens (slot -1) and NaN in every cache slot no sequence uses: reading past ``seq_len`` or an
unused block fails loudly.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.attention.backends import get_attn_backend
from pagedllm.attention.backends.cpu_backend import (
    KERNEL_CHUNK_MAX_CONTEXT,
    SDPA_CAUSAL_MIN_TOKENS,
    CpuAttentionBackend,
    CpuInvariantAttentionBackend,
    write_to_paged_cache_indexed,
)
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.cpu.build import available as cpu_kernels_available

# (atol, rtol) against the float32 oracle run on the same (rounded) inputs.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def make_step(
    context_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    num_padding_tokens: int = 0,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor], AttentionMetadata]:
    """(query, key, value, (key_cache, value_cache), metadata) of one step; decodes first.

    Sequence i has context_lens[i] cached tokens and query_lens[i] new ones.
    """
    gen = torch.Generator().manual_seed(seed)
    num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[sum(blocks_per_seq[:i]) : sum(blocks_per_seq[: i + 1])]

    def slots(i: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return block_tables[i, pos // block_size].long() * block_size + pos % block_size

    caches = tuple(
        torch.full((num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
        for _ in range(2)
    )
    for i, ctx in enumerate(context_lens):
        for cache in caches:
            context = torch.randn(ctx, num_kv_heads, head_size, generator=gen).to(dtype)
            cache.view(-1, num_kv_heads, head_size)[slots(i, 0, ctx)] = context
    slot_mapping = torch.cat(
        [slots(i, c, c + q) for i, (c, q) in enumerate(zip(context_lens, query_lens))]
        + [torch.full((num_padding_tokens,), -1, dtype=torch.int64)]
    )
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    md = AttentionMetadata(
        num_decodes=num_decodes,
        num_prefills=len(seq_lens) - num_decodes,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_t,
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_t,
    )
    num_tokens = slot_mapping.shape[0]
    q, k, v = (
        torch.randn(num_tokens, h, head_size, generator=gen).to(dtype)
        for h in (num_heads, num_kv_heads, num_kv_heads)
    )
    return q, k, v, caches, md


def clone_caches(caches: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return caches[0].clone(), caches[1].clone()


# (context_lens, query_lens): decodes only (few: SDPA; many: the batched matmuls; one: the
# unmasked window), prefills only, mixed batches with cached prefixes. With the kernel, each step
# is one call up to KERNEL_CHUNK_MAX_CONTEXT.
BATCHES = [
    ([37], [1]),
    ([0], [1]),
    ([3 + 5 * i for i in range(12)], [1] * 12),
    ([5, 17, 31, 0], [1, 1, 1, 1]),
    ([0, 0], [7, 23]),
    ([9, 40, 0, 12, 3], [1, 1, 19, 6, 1 + 4]),
    ([64, 1], [1, 33]),
    # Longer chunks, fresh and behind a prefix.
    ([10, 0, 5, 0, 150], [1, 80, 2, 65, 30]),
    # Fresh prompts on either side of SDPA_CAUSAL_MIN_TOKENS (causal SDPA from it) beside a
    # decode and a chunk behind a prefix.
    ([9, 0, 0, 0, 12], [1, SDPA_CAUSAL_MIN_TOKENS - 1, SDPA_CAUSAL_MIN_TOKENS, 300, 20]),
    # Contexts past KERNEL_CHUNK_MAX_CONTEXT: the kernel keeps the decodes, SDPA takes the chunks.
    ([KERNEL_CHUNK_MAX_CONTEXT + 52, 7, 0], [1, 1, 40]),
    ([30, KERNEL_CHUNK_MAX_CONTEXT + 22], [1, 25]),
]


@pytest.fixture(params=["kernel", "pytorch"])
def use_kernel(request: pytest.FixtureRequest) -> bool:
    if request.param == "kernel":
        # A machine with a C++ compiler (CI's) must build it: never a silent fall back here.
        assert cpu_kernels_available(), "the CPU attention kernel did not build (see the log)"
    return request.param == "kernel"


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 3), (8, 2), (9, 3)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_matches_torch_oracle(
    batch: tuple[list[int], list[int]],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype,
    use_kernel: bool,
) -> None:
    context_lens, query_lens = batch
    head_size = 32
    q, k, v, caches, md = make_step(
        context_lens, query_lens, num_heads, num_kv_heads, head_size, block_size, dtype, num_padding_tokens=2
    )
    scale = head_size**-0.5
    ours_caches, ref_caches = clone_caches(caches), clone_caches(caches)
    backend = CpuAttentionBackend(num_heads, head_size, scale, num_kv_heads)
    backend.use_kernel = use_kernel
    out = backend.forward(q, k, v, ours_caches, md)
    ref = TorchAttentionBackend(num_heads, head_size, scale, num_kv_heads).forward(q, k, v, ref_caches, md)
    num_real = int(md.query_start_loc_cpu[-1])
    assert out.dtype == dtype
    assert not out[:num_real].isnan().any()
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out[:num_real].float(), ref[:num_real].float(), atol=atol, rtol=rtol)
    # Both wrote the same slots (NaN == NaN where neither wrote).
    for ours, theirs in zip(ours_caches, ref_caches):
        torch.testing.assert_close(ours, theirs, equal_nan=True, atol=0, rtol=0)


def test_index_write_skips_padding_and_writes_in_cache_dtype() -> None:
    key_cache = torch.full((3, 4, 2, 8), float("nan"), dtype=torch.bfloat16)
    value_cache = key_cache.clone()
    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    write_to_paged_cache_indexed(key, value, key_cache, value_cache, torch.tensor([5, -1, 0, 11]))
    flat_k, flat_v = key_cache.view(-1, 2, 8), value_cache.view(-1, 2, 8)
    for token, slot in ((0, 5), (2, 0), (3, 11)):
        assert torch.equal(flat_k[slot], key[token].bfloat16())
        assert torch.equal(flat_v[slot], value[token].bfloat16())
    written = {0, 5, 11}
    assert all(flat_k[s].isnan().all() for s in range(12) if s not in written)


def reference_attention(
    q: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    alibi_slopes: torch.Tensor | None,
    soft_cap: float | None,
) -> torch.Tensor:
    """Token by token, head by head, in float64, from the caches after the write."""
    key_cache, value_cache = caches
    block_size, num_kv_heads, head_size = key_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(md.num_seqs):
        start, end = int(md.query_start_loc_cpu[i]), int(md.query_start_loc_cpu[i + 1])
        seq_len = int(md.seq_lens_cpu[i])
        pos = torch.arange(seq_len)
        slots = md.block_tables[i, pos // block_size].long() * block_size + pos % block_size
        keys = key_cache.view(-1, num_kv_heads, head_size)[slots].double()
        values = value_cache.view(-1, num_kv_heads, head_size)[slots].double()
        for t in range(start, end):
            q_pos = seq_len - (end - start) + (t - start)
            for h in range(q.shape[1]):
                s = keys[:, h // group] @ q[t, h].double() * scale
                if soft_cap is not None:
                    s = soft_cap * torch.tanh(s / soft_cap)
                if alibi_slopes is not None:
                    s = s + alibi_slopes[h].double() * (pos - q_pos)
                allowed = pos <= q_pos
                if sliding_window is not None:
                    allowed &= pos > q_pos - sliding_window
                p = torch.softmax(s.masked_fill(~allowed, -math.inf), dim=0)
                out[t, h] = p @ values[:, h // group]
    return out


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize(
    "sliding_window, use_alibi, soft_cap",
    [(4, False, None), (None, True, None), (None, False, 5.0), (7, True, 2.0)],
)
def test_cpu_backend_score_options_match_formula(
    batch: tuple[list[int], list[int]],
    sliding_window: int | None,
    use_alibi: bool,
    soft_cap: float | None,
    use_kernel: bool,
) -> None:
    num_heads, num_kv_heads, head_size = 6, 2, 16
    context_lens, query_lens = batch
    q, k, v, caches, md = make_step(
        context_lens, query_lens, num_heads, num_kv_heads, head_size, 4, torch.float32
    )
    slopes = 2.0 ** (-torch.arange(1, num_heads + 1, dtype=torch.float32)) if use_alibi else None
    scale = head_size**-0.5
    backend = CpuAttentionBackend(
        num_heads,
        head_size,
        scale,
        num_kv_heads,
        sliding_window=sliding_window,
        alibi_slopes=slopes,
        logits_soft_cap=soft_cap,
    )
    backend.use_kernel = use_kernel
    out = backend.forward(q, k, v, caches, md)
    ref = reference_attention(q, caches, md, scale, sliding_window, slopes, soft_cap)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"sliding_window": 0}, "sliding_window"),
        ({"alibi_slopes": torch.ones(3)}, "alibi_slopes"),
        ({"logits_soft_cap": 0.0}, "logits_soft_cap"),
    ],
)
def test_cpu_backend_rejects_bad_options(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CpuAttentionBackend(4, 16, 0.25, 2, **kwargs)


def test_auto_picks_cpu_backend_on_cpu_and_cpu_refuses_other_devices() -> None:
    assert get_attn_backend("auto", torch.device("cpu")) is CpuAttentionBackend
    with pytest.raises(ValueError, match="CPU only"):
        CpuAttentionBackend.check_supported(64, 16, torch.float32, torch.device("cuda"))


def test_the_invariant_variant_gives_a_prompt_the_same_bits_whole_or_in_chunks() -> None:
    """batch_invariant=True on the CPU: a prompt long enough for causal SDPA goes through the
    kernel instead, so prefilled whole or as a chunk behind its cached first part it gets the same
    bits (the default backend's causal SDPA would sum in other tiles)."""
    assert get_attn_backend("auto", torch.device("cpu"), batch_invariant=True) is CpuInvariantAttentionBackend
    assert get_attn_backend("auto", torch.device("cpu")) is CpuAttentionBackend
    num_heads, num_kv_heads, head_size, length, cut = 6, 3, 32, 2 * SDPA_CAUSAL_MIN_TOKENS, 50
    backend = CpuInvariantAttentionBackend(num_heads, head_size, head_size**-0.5, num_kv_heads)
    assert not backend.causal_prefill
    q, k, v, caches, md = make_step([0], [length], num_heads, num_kv_heads, head_size, 16, torch.bfloat16)
    whole = backend.forward(q, k, v, caches, md)
    # The same prompt's last part as a chunk behind its first ``cut`` tokens, read from the cache.
    _, _, _, _, chunk_md = make_step(
        [cut], [length - cut], num_heads, num_kv_heads, head_size, 16, torch.bfloat16
    )
    chunk_md.block_tables[:] = md.block_tables[:, : chunk_md.block_tables.shape[1]]
    chunk_md.slot_mapping = md.slot_mapping[cut:]
    chunk = backend.forward(q[cut:], k[cut:], v[cut:], caches, chunk_md)
    assert torch.equal(chunk, whole[cut:])
