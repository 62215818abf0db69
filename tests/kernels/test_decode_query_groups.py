"""paged_decode's query groups: a request's verified tokens, expanded into one decode sequence each,
attended by one program per KV head and partition (kernels/triton/paged_decode.py), against a
float64 torch reference and against the same launch without groups.

On the CPU under Triton's interpreter (conftest.py), else on CUDA. Tiles and partitions are tiny
so that groups straddle partition and tile boundaries, partitions start past some of a group's
tokens, and drafts are cut (groups shorter than the launch's bound). Every cache slot no request
owns holds NaN, and so does the output before the launch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton", reason="the triton attention backend needs the triton package")

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.attention.backends.triton_backend import TritonAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.triton import paged_decode

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")

# (context before the step, tokens the step verifies) per request: a group from key 0, groups
# across the partition boundaries at 32 and 64 (partitions of 32 tokens), one whose partition 1
# starts past its first token (31 + 3: tokens at 31, 32, 33), a lone decode, drafts cut short.
REQUESTS = [(0, 4), (28, 4), (31, 3), (5, 1), (60, 4), (100, 2), (17, 4)]


@dataclass
class Groups:
    """Expanded verifications in a Triton-layout cache: sequence i is a token of a request, its
    context that request's first ``seq_lens[i]`` tokens through the request's block table."""

    query: torch.Tensor  # [num_seqs, num_heads, head_size]
    key_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, width] int32, a request's row repeated per token
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_lens: torch.Tensor  # [num_seqs] int32: the groups (step_inputs.decode_query_lens)
    num_real: int  # sequences before the padding rows


def make_groups(
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    num_padding: int = 0,
    seed: int = 0,
) -> Groups:
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-(c + q) // block_size) for c, q in requests]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    caches = [torch.full(shape, float("nan")) for _ in range(2)]
    tables, seq_lens, query_lens = [], [], []
    for (context, q), n in zip(requests, blocks):
        row, perm = perm[:n], perm[n:]
        for cache in caches:  # the context and the step's tokens are in the cache already
            for pos in range(context + q):
                cache[row[pos // block_size], :, pos % block_size] = torch.randn(
                    num_kv_heads, head_size, generator=gen
                )
        tables += [row] * q
        seq_lens += range(context + 1, context + q + 1)
        query_lens += [0] * (q - 1) + [q]
    # A graph's padding rows: lone decodes of one key in block 0.
    tables += [[0]] * num_padding
    seq_lens += [1] * num_padding
    query_lens += [1] * num_padding
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen)
    return Groups(
        query.to(dtype).to(DEVICE),
        caches[0].to(dtype).to(DEVICE),
        caches[1].to(dtype).to(DEVICE),
        block_tables.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        torch.tensor(query_lens, dtype=torch.int32, device=DEVICE),
        len(seq_lens) - num_padding,
    )


def reference(
    g: Groups,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each real sequence's one query over its context, in float64."""
    num_heads, block_size = g.query.shape[1], g.key_cache.shape[2]
    group = num_heads // g.key_cache.shape[1]
    out = torch.empty(g.num_real, *g.query.shape[1:], dtype=torch.float64)
    for s in range(g.num_real):
        length = int(g.seq_lens[s])
        pos = torch.arange(length)
        blocks = g.block_tables[s].cpu()[pos // block_size].long()
        k, v = (
            c.cpu()[blocks, :, pos % block_size].double().repeat_interleave(group, 1)
            for c in (g.key_cache, g.value_cache)
        )
        scores = torch.einsum("hd,nhd->hn", g.query[s].cpu().double(), k) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.cpu().double()[:, None] * (pos - (length - 1)).double()
        if sinks is not None:  # one more logit per head, attending to nothing
            scores = torch.cat([scores, sinks.cpu().double()[:, None]], 1)
        probs = scores.softmax(-1)[:, :length]
        out[s] = torch.einsum("hn,nhd->hd", probs, v)
    return out


def launch(g: Groups, grouped: bool, max_query_len: int, max_seq_len: int, partition_size: int, **variants):
    out = torch.full_like(g.query, float("nan"))
    groups = {"query_lens": g.query_lens, "max_query_len": max_query_len} if grouped else {}
    paged_decode(
        g.query,
        g.key_cache,
        g.value_cache,
        g.block_tables,
        g.seq_lens,
        g.query.shape[-1] ** -0.5,
        max_seq_len,
        out,
        partition_size=partition_size,
        block_n=16,
        **groups,
        **variants,
    )
    return out


# (num_heads, num_kv_heads, head_size, block_size, dtype, max_query_len): query heads per KV head
# 1, 2, 3, 4 and 8 (groups of 4 x 4 rows fill the 16-row tile; 5 x 3 and 4 x 8 pad past it), head
# sizes padded or not, every block size, a 16-bit dtype.
CASES = [
    (4, 4, 64, 16, torch.float32, 4),
    (4, 2, 64, 8, torch.float32, 4),
    (6, 2, 80, 16, torch.float32, 5),
    (8, 2, 64, 32, torch.float32, 4),
    (16, 2, 64, 16, torch.float32, 4),
    (8, 2, 128, 16, torch.float16, 4),
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3}


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"h{c[0]}-kv{c[1]}-d{c[2]}-b{c[3]}-{str(c[4])[6:]}-q{c[5]}"
)
@pytest.mark.parametrize(
    ("max_seq_len", "partition_size"), [(128, 32), (128, 512)], ids=["split", "one-partition"]
)
def test_query_groups_match_the_reference_and_the_launch_without_them(case, max_seq_len, partition_size):
    num_heads, num_kv_heads, head_size, block_size, dtype, max_query_len = case
    requests = [(c, min(q, max_query_len)) for c, q in REQUESTS]
    g = make_groups(requests, num_heads, num_kv_heads, head_size, block_size, dtype, num_padding=3)
    grouped = launch(g, True, max_query_len, max_seq_len, partition_size)
    plain = launch(g, False, 1, max_seq_len, partition_size)
    real = slice(0, g.num_real)
    assert not grouped[real].isnan().any(), "a token of a group was not written"
    tol = TOLERANCE[dtype]
    expected = reference(g, head_size**-0.5)
    torch.testing.assert_close(grouped[real].double().cpu(), expected, atol=tol, rtol=tol)
    # The same tiles and partitions per row: the launch without groups agrees to rounding.
    torch.testing.assert_close(grouped[real], plain[real], atol=tol / 10, rtol=tol / 10)


@pytest.mark.parametrize(
    "variant",
    ["alibi", "soft_cap", "learned_sinks", "fp8_cache"],
)
def test_query_groups_with_the_variants_they_allow(variant):
    num_heads, num_kv_heads, head_size, max_query_len = 8, 2, 64, 4
    dtype = torch.float16 if variant == "fp8_cache" else torch.float32
    g = make_groups(REQUESTS, num_heads, num_kv_heads, head_size, 16, dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    variants, ref_variants = {}, {}
    if variant == "alibi":
        slopes = torch.rand(num_heads, generator=gen)
        variants = ref_variants = {"alibi_slopes": slopes.to(DEVICE)}
    elif variant == "soft_cap":
        g.query *= 8  # scores past the cap
        variants = ref_variants = {"logits_soft_cap": 5.0}
    elif variant == "learned_sinks":
        variants = ref_variants = {"sinks": torch.randn(num_heads, generator=gen).to(DEVICE)}
    else:
        scales = (torch.tensor(0.5), torch.tensor(2.0))
        k8, v8 = (
            (c.float() / s).to(torch.float8_e4m3fn) for c, s in zip((g.key_cache, g.value_cache), scales)
        )
        g.key_cache, g.value_cache = k8, v8
        variants = {"k_scale": scales[0].to(DEVICE), "v_scale": scales[1].to(DEVICE)}
    grouped = launch(g, True, max_query_len, 128, 32, **variants)
    plain = launch(g, False, 1, 128, 32, **variants)
    if variant == "fp8_cache":  # the reference reads the cache as the kernels do: dequantized
        g.key_cache = g.key_cache.float() * 0.5
        g.value_cache = g.value_cache.float() * 2.0
    tol = 4e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(
        grouped.double().cpu(), reference(g, head_size**-0.5, **ref_variants), atol=tol, rtol=tol
    )
    torch.testing.assert_close(grouped, plain, atol=tol / 10, rtol=tol / 10)


def test_a_group_is_attended_by_its_last_sequence_alone():
    """With every entry 0 no program attends (each exits as a group's other member; one partition,
    so no reduce runs after them); with the groups, the outputs of the sequences before each last
    one are written by it."""
    g = make_groups([(10, 3), (40, 4)], 4, 2, 64, 16, torch.float32)
    g.query_lens.zero_()
    assert launch(g, True, 4, 64, 512).isnan().all()
    g.query_lens.copy_(torch.tensor([0, 0, 3, 0, 0, 0, 4], dtype=torch.int32))
    out = launch(g, True, 4, 64, 32)
    assert not out.isnan().any()
    # Groups cut wrongly (the first request's three as a group of two ending at its second token)
    # give its first two tokens the contexts of the request's last two: not the reference.
    g.query_lens.copy_(torch.tensor([0, 2, 1, 0, 0, 0, 4], dtype=torch.int32))
    g.seq_lens[:3] = torch.tensor([12, 13, 13], dtype=torch.int32)
    wrong = launch(g, True, 4, 64, 32)
    assert not torch.allclose(wrong[:2], out[:2])


@pytest.mark.parametrize(
    "variant",
    [{"sliding_window": 8}, {"lse": "lse"}],
    ids=["window", "partial"],
)
def test_query_groups_refuse_what_their_rows_cannot_share(variant):
    g = make_groups([(10, 3)], 4, 2, 64, 16, torch.float32)
    if "lse" in variant:
        variant = {"lse": torch.empty(g.query.shape[:2], device=DEVICE)}
    with pytest.raises(AssertionError, match="query groups"):
        launch(g, True, 4, 64, 32, **variant)


def _metadata(g: Groups, max_query_len: int) -> AttentionMetadata:
    """The step's metadata as stage_model_input makes it: decodes only, their tokens already in
    the cache (slot -1: the step writes nothing more)."""
    n = g.query.shape[0]
    return AttentionMetadata(
        num_decodes=n,
        num_prefills=0,
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=g.seq_lens,
        block_tables=g.block_tables,
        max_query_len=1,
        max_seq_len=int(g.seq_lens.max()),
        query_start_loc_cpu=torch.arange(n + 1, dtype=torch.int32),
        seq_lens_cpu=g.seq_lens.cpu(),
        decode_query_lens=g.query_lens,
        max_decode_query_len=max_query_len,
    )


@pytest.mark.parametrize("sliding_window", [None, 12])
def test_the_backend_groups_the_layers_that_can_and_leaves_the_others(sliding_window):
    """A plain layer takes the metadata's groups; a windowed one attends per sequence. Both give
    the torch backend's output for the step."""
    num_heads, num_kv_heads, head_size = 8, 2, 64
    g = make_groups(REQUESTS, num_heads, num_kv_heads, head_size, 16, torch.float32, seed=3)
    md = _metadata(g, 4)
    scale = head_size**-0.5
    layer = TritonAttentionBackend(num_heads, head_size, scale, num_kv_heads, sliding_window=sliding_window)
    assert layer.groups_queries == (sliding_window is None)
    # A rank of a striped cache (context parallelism) holds every other key: no groups either.
    striped = TritonAttentionBackend(num_heads, head_size, scale, num_kv_heads, cp_rank=1, cp_world_size=2)
    assert not striped.groups_queries
    key = torch.zeros(g.query.shape[0], num_kv_heads, head_size, device=DEVICE)
    out = layer.forward(g.query, key, key, (g.key_cache, g.value_cache), md)
    oracle = TorchAttentionBackend(num_heads, head_size, scale, num_kv_heads, sliding_window=sliding_window)
    torch_caches = tuple(c.permute(0, 2, 1, 3).contiguous() for c in (g.key_cache, g.value_cache))
    expected = oracle.forward(g.query, key, key, torch_caches, md)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
