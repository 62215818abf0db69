"""The Triton attention kernels and backend against the torch oracle, on small ragged batches.

Runs on the CPU under TRITON_INTERPRET=1 (set by conftest.py when there is no GPU), else on CUDA.
Shapes are kept small and partitions/tiles tiny so that the interpreter stays fast while every code
path still runs: several partitions per sequence, tails that end mid-block and mid-tile, padded
GQA groups, padded head dims, chunks attending to a cached prefix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton", reason="the triton attention backend needs the triton package")

from pagedllm.attention.backends import get_attn_backend
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.attention.backends.triton_backend import TritonAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.triton import paged_decode, paged_prefill, reshape_and_cache

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")

# Triton's interpreter stores bfloat16 as raw uint16 and does arithmetic (tl.dot included) on the
# bit patterns; its docs list bfloat16 as unsupported (see triton-lang/triton#11584). Copies are
# fine, so only the attention tests skip it there; tests/gpu covers bfloat16 on the device.
BF16_NEEDS_GPU = pytest.mark.skipif(INTERPRET, reason="Triton's interpreter has no bfloat16 arithmetic")

# (atol, rtol) against the float32 oracle. float32 dots are exact ("ieee"); 16-bit runs round P
# to the cache dtype before the P @ V dot, as FlashAttention does.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


@dataclass
class PagedBatch:
    """One step's inputs with the cached context already in a Triton-layout cache."""

    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_size], this step's new tokens
    value: torch.Tensor
    key_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_size]; NaN where unused
    value_cache: torch.Tensor
    md: AttentionMetadata

    def torch_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The same caches in the torch backend's [num_blocks, block_size, num_kv_heads, head_size]."""
        return (
            self.key_cache.permute(0, 2, 1, 3).contiguous(),
            self.value_cache.permute(0, 2, 1, 3).contiguous(),
        )


def make_batch(
    num_decodes: int,
    context_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    num_padding_tokens: int = 0,
    seed: int = 0,
) -> PagedBatch:
    """A batch whose sequence i has context_lens[i] cached tokens and query_lens[i] new ones.

    The first ``num_decodes`` sequences are decodes (query_len 1). Physical blocks are shuffled
    so block tables are not contiguous; every cache slot no sequence uses holds NaN, so a kernel
    that reads past seq_len (or an unused block) fails loudly. ``num_padding_tokens`` trailing
    tokens have slot -1.
    """
    gen = torch.Generator().manual_seed(seed)
    assert all(q == 1 for q in query_lens[:num_decodes])
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    first = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[first : first + n]
        first += n

    def slots(i: int, positions: range) -> torch.Tensor:
        pos = torch.tensor(list(positions), dtype=torch.int64)
        return block_tables[i, pos // block_size].long() * block_size + pos % block_size

    cache_shape = (num_blocks, num_kv_heads, block_size, head_size)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    for i, ctx in enumerate(context_lens):
        s = slots(i, range(ctx))
        for cache in (key_cache, value_cache):
            context = torch.randn(ctx, num_kv_heads, head_size, generator=gen)
            cache[s // block_size, :, s % block_size] = context.to(dtype)

    slot_mapping = torch.cat(
        [slots(i, range(c, c + q)) for i, (c, q) in enumerate(zip(context_lens, query_lens))]
        + [torch.full((num_padding_tokens,), -1, dtype=torch.int64)]
    )
    num_tokens = slot_mapping.shape[0]
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    md = AttentionMetadata(
        num_decodes=num_decodes,
        num_prefills=len(seq_lens) - num_decodes,
        slot_mapping=slot_mapping.to(DEVICE),
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=seq_lens_t.to(DEVICE),
        block_tables=block_tables.to(DEVICE),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_t,
    )

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(num_tokens, heads, head_size, generator=gen).to(dtype).to(DEVICE)

    query, key, value = rand(num_heads), rand(num_kv_heads), rand(num_kv_heads)
    return PagedBatch(query, key, value, key_cache.to(DEVICE), value_cache.to(DEVICE), md)


def oracle(
    batch: PagedBatch, num_heads: int, num_kv_heads: int, head_size: int, **variants: object
) -> torch.Tensor:
    """The torch backend's output for the batch's real tokens (its caches are copies); variants
    are the backends' keyword arguments (sliding_window, alibi_slopes, logits_soft_cap)."""
    backend = TorchAttentionBackend(num_heads, head_size, head_size**-0.5, num_kv_heads, **variants)
    out = backend.forward(batch.query, batch.key, batch.value, batch.torch_caches(), batch.md)
    return out[: int(batch.md.query_start_loc_cpu[-1])]


@dataclass(frozen=True)
class Launch:
    """Tiny tiles and partitions: several partitions and tiles per sequence at test sizes."""

    partition_size: int = 32
    decode_block_n: int = 16
    block_m: int = 16
    prefill_block_n: int = 16


def run_kernels(
    batch: PagedBatch, head_size: int, max_seq_len: int, launch: Launch, **variants: object
) -> torch.Tensor:
    """Cache write, then the decode and prefill kernels into a NaN-poisoned output."""
    md = batch.md
    scale = head_size**-0.5
    reshape_and_cache(batch.key, batch.value, batch.key_cache, batch.value_cache, md.slot_mapping)
    out = torch.full_like(batch.query, float("nan"))
    nd = md.num_decodes
    if nd:
        paged_decode(
            batch.query[:nd],
            batch.key_cache,
            batch.value_cache,
            md.block_tables[:nd],
            md.seq_lens[:nd],
            scale,
            max_seq_len,
            out[:nd],
            partition_size=launch.partition_size,
            block_n=launch.decode_block_n,
            **variants,
        )
    paged_prefill(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        md.block_tables,
        md.seq_lens,
        md.query_start_loc,
        scale,
        nd,
        md.num_prefills,
        md.max_query_len,
        out,
        block_m=launch.block_m,
        block_n=launch.prefill_block_n,
        **variants,
    )
    return out[: int(md.query_start_loc_cpu[-1])]


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements never written (or NaN)"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "dtype, num_kv_heads, head_size",
    [(torch.float32, 2, 64), (torch.bfloat16, 3, 80), (torch.float16, 1, 256)],
)
def test_reshape_and_cache_writes_slots_and_skips_padding(
    dtype: torch.dtype, num_kv_heads: int, head_size: int
) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_tokens = 5, 8, 13
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[[2, 7, 12]] = -1  # padding tokens: never written
    # K and V as views of one fused projection output, as the attention layer passes them.
    kv = torch.randn(num_tokens, 2 * num_kv_heads * head_size, generator=gen).to(dtype).to(DEVICE)
    key = kv[:, : num_kv_heads * head_size].view(num_tokens, num_kv_heads, head_size)
    value = kv[:, num_kv_heads * head_size :].view(num_tokens, num_kv_heads, head_size)
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    key_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    value_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping.to(DEVICE))

    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    for cache, src in ((key_cache, key), (value_cache, value)):
        expected = torch.full(shape, float("nan"), dtype=dtype)
        expected[slots // block_size, :, slots % block_size] = src.cpu()[valid]
        torch.testing.assert_close(cache.cpu(), expected, atol=0, rtol=0, equal_nan=True)


# (num_heads, num_kv_heads, head_size, block_size, dtype): GQA ratios 1/2/4/8 and MQA, padded
# head dims (80, 96, 112, 192), every block size, 16-bit dtypes.
CASES = [
    (4, 4, 64, 16, torch.float32),
    (4, 2, 64, 16, torch.float32),
    (8, 2, 64, 8, torch.float32),
    (16, 2, 64, 32, torch.float32),
    (8, 1, 64, 16, torch.float32),
    (4, 2, 80, 16, torch.float32),
    (4, 2, 96, 8, torch.float32),
    (2, 1, 112, 16, torch.float32),
    (4, 2, 128, 32, torch.float32),
    (2, 1, 192, 16, torch.float32),
    (4, 2, 256, 16, torch.float32),
    (8, 2, 80, 16, torch.float16),
    (8, 1, 96, 32, torch.float16),
    pytest.param((8, 2, 128, 16, torch.bfloat16), marks=BF16_NEEDS_GPU),
]


def _case_id(case: tuple) -> str:
    num_heads, num_kv_heads, head_size, block_size, dtype = case
    return f"h{num_heads}-kv{num_kv_heads}-d{head_size}-b{block_size}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_decode_matches_torch(case: tuple) -> None:
    num_heads, num_kv_heads, head_size, block_size, dtype = case
    # seq_lens 1, 9, 32, 48, 71, 100: one token, mid-block, exactly one partition, several
    # partitions ending mid-block and mid-tile.
    context_lens = [0, 8, 31, 47, 70, 99]
    batch = make_batch(6, context_lens, [1] * 6, num_heads, num_kv_heads, head_size, block_size, dtype)
    ref = oracle(batch, num_heads, num_kv_heads, head_size)
    # A host bound above every seq_len, as under CUDA graphs: the extra partitions must exit.
    out = run_kernels(batch, head_size, max_seq_len=140, launch=Launch())
    assert_matches(out, ref, dtype)


def test_decode_single_partition_writes_output_directly() -> None:
    batch = make_batch(3, [0, 13, 40], [1, 1, 1], 8, 2, 64, 16, torch.float32)
    ref = oracle(batch, 8, 2, 64)
    out = run_kernels(batch, 64, max_seq_len=64, launch=Launch(partition_size=64))
    assert_matches(out, ref, torch.float32)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_prefill_matches_torch(case: tuple) -> None:
    num_heads, num_kv_heads, head_size, block_size, dtype = case
    # A fresh prompt over several query tiles, chunks after a cached prefix (prefix caching,
    # chunked prefill) that start and end mid-block, a one-token chunk, and a chunk whose first
    # query sits one short of a key-tile boundary (the edge of the unmasked stage).
    context_lens = [0, 21, 16, 45, 30]
    query_lens = [37, 5, 16, 1, 3]
    batch = make_batch(0, context_lens, query_lens, num_heads, num_kv_heads, head_size, block_size, dtype)
    ref = oracle(batch, num_heads, num_kv_heads, head_size)
    out = run_kernels(batch, head_size, max_seq_len=batch.md.max_seq_len, launch=Launch())
    assert_matches(out, ref, dtype)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=BF16_NEEDS_GPU)]
)
def test_backend_forward_mixed_batch(dtype: torch.dtype) -> None:
    num_heads, num_kv_heads, head_size, block_size = 8, 2, 64, 16
    # Three decodes, then two prefill chunks (one with a cached prefix), then CUDA-graph padding.
    context_lens = [5, 40, 17, 0, 24]
    query_lens = [1, 1, 1, 20, 9]
    batch = make_batch(
        3,
        context_lens,
        query_lens,
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        dtype,
        num_padding_tokens=3,
    )
    ref = oracle(batch, num_heads, num_kv_heads, head_size)
    backend_cls = get_attn_backend("triton", DEVICE)
    assert backend_cls is TritonAttentionBackend
    backend_cls.check_supported(head_size, block_size, dtype, DEVICE)
    backend = backend_cls(num_heads, head_size, head_size**-0.5, num_kv_heads)
    # q, k, v as strided views of one fused QKV projection output, as models produce them.
    num_tokens = batch.query.shape[0]
    qkv = torch.cat([batch.query.flatten(1), batch.key.flatten(1), batch.value.flatten(1)], dim=1)
    query, key, value = qkv.split([num_heads * head_size, *[num_kv_heads * head_size] * 2], dim=1)
    out = backend.forward(
        query.view(num_tokens, num_heads, head_size),
        key.view(num_tokens, num_kv_heads, head_size),
        value.view(num_tokens, num_kv_heads, head_size),
        (batch.key_cache, batch.value_cache),
        batch.md,
    )
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert_matches(out[: int(batch.md.query_start_loc_cpu[-1])], ref, dtype)


@pytest.mark.parametrize("seed", range(4))
def test_random_ragged_batches_match_torch(seed: int) -> None:
    rng = torch.Generator().manual_seed(seed)

    def pick(options: list) -> object:
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    num_kv_heads = pick([1, 2])
    num_heads = num_kv_heads * pick([1, 2, 4, 8])
    head_size, block_size = pick([64, 80, 96, 128]), pick([8, 16, 32])
    num_decodes, num_prefills = int(torch.randint(0, 5, (1,), generator=rng)), 3
    context_lens = torch.randint(0, 90, (num_decodes + num_prefills,), generator=rng).tolist()
    query_lens = [1] * num_decodes + torch.randint(1, 40, (num_prefills,), generator=rng).tolist()
    batch = make_batch(
        num_decodes,
        context_lens,
        query_lens,
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        torch.float32,
        num_padding_tokens=2,
        seed=seed,
    )
    ref = oracle(batch, num_heads, num_kv_heads, head_size)
    out = run_kernels(batch, head_size, max_seq_len=128, launch=Launch())
    assert_matches(out, ref, torch.float32)


def _variant_cases() -> list:
    """(id, variants as functions of num_heads): windows smaller than a tile, a block, a
    partition, and larger than most contexts; ALiBi; soft caps that bite; and a mix."""
    slopes = lambda h: torch.linspace(0.05, 0.5, h)  # noqa: E731 - a table of small lambdas
    return [
        ("window1", lambda h: {"sliding_window": 1}),
        ("window5", lambda h: {"sliding_window": 5}),
        ("window16", lambda h: {"sliding_window": 16}),
        ("window37", lambda h: {"sliding_window": 37}),
        ("window200", lambda h: {"sliding_window": 200}),
        ("alibi", lambda h: {"alibi_slopes": slopes(h)}),
        ("softcap", lambda h: {"logits_soft_cap": 2.0}),
        ("window-softcap", lambda h: {"sliding_window": 19, "logits_soft_cap": 5.0}),
        ("window-alibi", lambda h: {"sliding_window": 23, "alibi_slopes": slopes(h)}),
    ]


VARIANT_CASES = _variant_cases()


@pytest.mark.parametrize("variant", [c[1] for c in VARIANT_CASES], ids=[c[0] for c in VARIANT_CASES])
@pytest.mark.parametrize("block_size", [8, 16])
def test_variants_decode_and_prefill_match_torch(variant, block_size: int) -> None:
    num_heads, num_kv_heads, head_size = 8, 2, 64
    # Decodes with several partitions (windows starting in the first, a middle and the last one),
    # a fresh prompt, chunks after a cached prefix longer than the windows, a one-token chunk.
    context_lens = [0, 8, 31, 47, 70, 99, 0, 60, 45, 21]
    query_lens = [1] * 6 + [40, 25, 1, 3]
    variants = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in variant(num_heads).items()}
    batch = make_batch(
        6, context_lens, query_lens, num_heads, num_kv_heads, head_size, block_size, torch.float32
    )
    ref = oracle(batch, num_heads, num_kv_heads, head_size, **variants)
    out = run_kernels(batch, head_size, max_seq_len=140, launch=Launch(), **variants)
    assert_matches(out, ref, torch.float32)


@pytest.mark.parametrize("seed", range(3))
def test_random_windows_match_torch(seed: int) -> None:
    rng = torch.Generator().manual_seed(100 + seed)
    num_kv_heads = int(torch.randint(1, 3, (1,), generator=rng))
    num_heads = num_kv_heads * int(torch.randint(1, 5, (1,), generator=rng))
    window = int(torch.randint(1, 70, (1,), generator=rng))
    num_decodes = int(torch.randint(1, 4, (1,), generator=rng))
    context_lens = torch.randint(0, 110, (num_decodes + 2,), generator=rng).tolist()
    query_lens = [1] * num_decodes + torch.randint(1, 50, (2,), generator=rng).tolist()
    batch = make_batch(
        num_decodes, context_lens, query_lens, num_heads, num_kv_heads, 64, 16, torch.float32, seed=seed
    )
    ref = oracle(batch, num_heads, num_kv_heads, 64, sliding_window=window)
    out = run_kernels(batch, 64, max_seq_len=160, launch=Launch(), sliding_window=window)
    assert_matches(out, ref, torch.float32)


def test_windowed_decode_reads_only_the_window() -> None:
    # Poison every cached token before the window: a kernel that reads them returns NaN.
    window, context = 20, 99
    batch = make_batch(1, [context], [1], 4, 2, 64, 16, torch.float32)
    ref = oracle(batch, 4, 2, 64, sliding_window=window)
    seq_len = context + 1
    table = batch.md.block_tables[0].cpu()
    for pos in range(seq_len - window):
        block, slot = int(table[pos // 16]), pos % 16
        batch.key_cache[block, :, slot] = float("nan")
        batch.value_cache[block, :, slot] = float("nan")
    out = run_kernels(batch, 64, max_seq_len=140, launch=Launch(), sliding_window=window)
    assert_matches(out, ref, torch.float32)


@pytest.mark.parametrize(
    "variants, match",
    [
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": -4}, "sliding_window"),
        ({"logits_soft_cap": 0.0}, "logits_soft_cap"),
        ({"alibi_slopes": torch.ones(3)}, "alibi_slopes"),
    ],
)
def test_bad_variants_are_refused(variants: dict, match: str) -> None:
    for backend in (TorchAttentionBackend, TritonAttentionBackend):
        with pytest.raises(ValueError, match=match):
            backend(4, 64, 0.125, 2, **variants)


def test_kv_cache_shape_keeps_block_first() -> None:
    shapes = TritonAttentionBackend.get_kv_cache_shape(10, 16, 8, 128, torch.bfloat16)
    assert shapes == ((10, 8, 16, 128), (10, 8, 16, 128))


@pytest.mark.parametrize(
    "head_size, block_size, dtype, match",
    [
        (100, 16, torch.float32, "head_size"),
        (128, 64, torch.float32, "block_size"),
        (128, 16, torch.float64, "dtype"),
    ],
)
def test_check_supported_names_what_is_unsupported(
    head_size: int, block_size: int, dtype: torch.dtype, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        TritonAttentionBackend.check_supported(head_size, block_size, dtype, DEVICE)


def test_check_supported_needs_cuda_or_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        TritonAttentionBackend.check_supported(128, 16, torch.bfloat16, torch.device("cpu"))
