"""The C++ CPU kernels (pagedllm/kernels/cpu) against the torch oracle on what the backend's and
the sampler's tests do not reach: other head sizes and float16, a query that is a strided view,
long contexts over many tiles, the rows the attention kernel must leave alone, the cache write's
padding and bounds, the argmax and log-sum-exp pass on ties and chunk edges, and the errors the
checks raise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_cpu_backend import make_step

from pagedllm.attention.backends.cpu_backend import write_to_paged_cache_indexed
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.kernels.cpu.build import available
from pagedllm.kernels.cpu.ops import argmax_logsumexp, paged_attention, reshape_and_cache

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


@pytest.fixture(autouse=True)
def built() -> None:
    # CI's machine has a compiler: a kernel that does not build there is a failure, not a skip.
    assert available(), "pagedllm's CPU kernels did not build (see the log)"


def run_both(context_lens, query_lens, num_heads, num_kv_heads, head_size, block_size, dtype, **options):
    """(kernel output, oracle output, number of real tokens) of one step; the kernel reads the
    caches after the same write the oracle does."""
    q, k, v, caches, md = make_step(
        context_lens, query_lens, num_heads, num_kv_heads, head_size, block_size, dtype, num_padding_tokens=1
    )
    scale = head_size**-0.5
    ref = TorchAttentionBackend(num_heads, head_size, scale, num_kv_heads, **options).forward(
        q, k, v, (caches[0].clone(), caches[1].clone()), md
    )
    write_to_paged_cache_indexed(k, v, *caches, md.slot_mapping)
    out = torch.full_like(q, 7.0)
    paged_attention(
        out, q, *caches, md.block_tables, md.seq_lens_cpu, md.query_start_loc_cpu, scale, **options
    )
    return out, ref, int(md.query_start_loc_cpu[-1])


@pytest.mark.parametrize("head_size", [8, 64, 80, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_oracle_across_head_sizes_and_dtypes(head_size: int, dtype: torch.dtype) -> None:
    # Decodes (enough to give each thread whole tokens), a chunk behind a prefix, a fresh prompt.
    context_lens, query_lens = [5 * i for i in range(9)] + [40, 0], [1] * 9 + [6, 11]
    out, ref, n = run_both(context_lens, query_lens, 8, 2, head_size, 16, dtype)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=atol, rtol=rtol)
    assert (out[n:] == 7.0).all()  # padding tokens untouched


@pytest.mark.parametrize("sliding_window", [None, 50, 300])
def test_kernel_long_contexts_span_many_tiles(sliding_window: int | None) -> None:
    # Contexts of several 32-key tiles, ending mid-tile and mid-block; one decode alone spreads
    # over KV heads, a batch over tokens.
    for context_lens in ([700], [333, 517, 64, 1000]):
        out, ref, n = run_both(
            context_lens, [1] * len(context_lens), 12, 4, 64, 16, torch.float32, sliding_window=sliding_window
        )
        torch.testing.assert_close(out[:n], ref[:n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (10, 2), (16, 2)])
@pytest.mark.parametrize("sliding_window", [None, 37])
def test_bf16_decodes_equal_a_float32_oracle_up_to_the_output_rounding(
    head_size: int, num_heads: int, num_kv_heads: int, sliding_window: int | None
) -> None:
    """bf16 decodes at the head sizes with a vectorised path (AVX512-BF16 where the CPU has it):
    groups of 1 to 8 query heads a KV head, contexts from 1 key to many 16-key tiles ending
    anywhere, one decode alone (items of one head) and a batch (items of every head). Against the
    oracle run in float32 on the same bf16 values, every output is within its own rounding to
    bf16 plus float32 noise: the scores and the softmax lose nothing to bf16."""
    for context_lens in ([0, 1, 14, 15, 16, 31, 100, 250, 40, 40, 40, 40, 7, 3, 2, 64], [77]):
        q, k, v, caches, md = make_step(
            context_lens, [1] * len(context_lens), num_heads, num_kv_heads, head_size, 16, torch.bfloat16
        )
        write_to_paged_cache_indexed(k, v, *caches, md.slot_mapping)
        scale = head_size**-0.5
        oracle = TorchAttentionBackend(
            num_heads, head_size, scale, num_kv_heads, sliding_window=sliding_window
        )
        ref = oracle.forward(q.float(), k.float(), v.float(), (caches[0].float(), caches[1].float()), md)
        out = torch.full_like(q, 7.0)
        paged_attention(
            out,
            q,
            *caches,
            md.block_tables,
            md.seq_lens_cpu,
            md.query_start_loc_cpu,
            scale,
            sliding_window=sliding_window,
        )
        # bf16 keeps 8 significant bits: rounding moves a value by at most 2^-8 of it.
        torch.testing.assert_close(out.float(), ref, atol=1e-5, rtol=2**-8)


def test_kernel_reads_a_strided_query_and_computes_only_the_sequences_it_is_given() -> None:
    q, k, v, caches, md = make_step([3, 20, 0], [1, 5, 9], 6, 3, 32, 4, torch.float32)
    write_to_paged_cache_indexed(k, v, *caches, md.slot_mapping)
    scale = 32**-0.5
    # The query as the model hands it: a view into a wider fused QKV row.
    fused = torch.cat([q.flatten(1), torch.randn(q.shape[0], 2 * 3 * 32)], dim=1)
    strided = fused[:, : 6 * 32].view(-1, 6, 32)
    assert not strided.is_contiguous()
    out, dense = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    args = (caches[0], caches[1], md.block_tables, md.seq_lens_cpu, md.query_start_loc_cpu, scale)
    # The first two sequences' metadata alone, as the backend passes its decodes.
    first_two = (md.block_tables[:2], md.seq_lens_cpu[:2], md.query_start_loc_cpu[:3], scale)
    paged_attention(out, strided, caches[0], caches[1], *first_two)
    paged_attention(dense, q, *args)
    assert torch.equal(out[:6], dense[:6])  # the decode and the 5-token chunk
    assert (out[6:] == 7.0).all()  # the 9-token chunk was not passed: left alone


def test_kernel_checks_name_what_is_wrong() -> None:
    q, _, _, (key_cache, value_cache), md = make_step([4], [1], 4, 2, 16, 4, torch.float32)
    out = torch.empty_like(q)
    common = (md.seq_lens_cpu, md.query_start_loc_cpu, 0.25)
    with pytest.raises(RuntimeError, match="share one dtype"):
        paged_attention(out, q, key_cache.bfloat16(), value_cache.bfloat16(), md.block_tables, *common)
    with pytest.raises(RuntimeError, match="int32"):
        paged_attention(out, q, key_cache, value_cache, md.block_tables.long(), *common)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        paged_attention(out[:, :3], q[:, :3], key_cache, value_cache, md.block_tables, *common)
    # Metadata that would send a read outside the cache is refused before anything is read.
    num_blocks = key_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        table = md.block_tables.clone()
        table[0, 1] = num_blocks
        paged_attention(out, q, key_cache, value_cache, table, *common)
    with pytest.raises(RuntimeError, match="needs more blocks"):
        long_context = torch.tensor([4 * md.block_tables.shape[1] + 1], dtype=torch.int32)
        paged_attention(out, q, key_cache, value_cache, md.block_tables, long_context, *common[1:])
    with pytest.raises(RuntimeError, match="queries for a context"):
        paged_attention(
            out, q, key_cache, value_cache, md.block_tables, torch.zeros(1, dtype=torch.int32), *common[1:]
        )


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (32, 49152), (5, 1024), (4, 1025), (2, 3000)])
def test_argmax_logsumexp_matches_torch(shape: tuple[int, int]) -> None:
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 8
    argmax, logsumexp = argmax_logsumexp(logits)
    assert torch.equal(argmax, logits.argmax(dim=-1))
    torch.testing.assert_close(logsumexp, torch.logsumexp(logits, dim=-1), atol=1e-5, rtol=1e-6)


def test_argmax_logsumexp_takes_the_first_maximum_across_chunks() -> None:
    logits = torch.zeros(3, 5000)
    logits[0, [7, 4000]] = 3.0  # a tie in two chunks: the first wins, as torch.argmax picks
    logits[1, [1500, 1501]] = 2.0  # a tie inside one chunk
    logits[2, 4999] = float("-inf")  # a banned token at the very end
    argmax, logsumexp = argmax_logsumexp(logits)
    assert argmax.tolist() == [7, 1500, 0]
    torch.testing.assert_close(logsumexp, torch.logsumexp(logits, dim=-1))
    # A strided view of the rows works too; a non-float32 input is refused by name.
    wide = torch.cat([logits, torch.full((3, 10), 99.0)], dim=1)[:, :5000]
    assert torch.equal(argmax_logsumexp(wide)[0], argmax)
    with pytest.raises(RuntimeError, match="float32"):
        argmax_logsumexp(logits.double())


def test_cache_write_matches_index_copy_skips_padding_and_refuses_slots_past_the_cache() -> None:
    fused = torch.randn(5, 3 * 2 * 8)  # [tokens, q | k | v] as the model's QKV projection
    key, value = fused[:, 16:32].view(5, 2, 8), fused[:, 32:].view(5, 2, 8)
    caches = [torch.full((3, 4, 2, 8), float("nan")) for _ in range(2)]
    expected = [c.clone() for c in caches]
    slots = torch.tensor([5, -1, 0, 11, -1])
    reshape_and_cache(key, value, *caches, slots)
    write_to_paged_cache_indexed(key, value, *expected, slots)
    for ours, theirs in zip(caches, expected):
        torch.testing.assert_close(ours, theirs, equal_nan=True, atol=0, rtol=0)
    before = [c.clone() for c in caches]
    with pytest.raises(RuntimeError, match="past the cache"):
        reshape_and_cache(key, value, *caches, torch.tensor([0, 1, 2, 12, 3]))
    for cache, kept in zip(caches, before):  # checked before anything is written
        torch.testing.assert_close(cache, kept, equal_nan=True, atol=0, rtol=0)


def test_build_names_what_is_missing_and_the_switch_turns_the_kernels_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagedllm.kernels.cpu import build

    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(RuntimeError, match=r"C\+\+ compiler.*nonexistent"):
        build.check_build_requirements()
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    assert build.available.__wrapped__() is False  # uncached: what a fresh process decides


def test_build_directory_changes_with_the_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pagedllm.kernels.cpu import build

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    first = build.cache_dir()
    assert first.is_relative_to(tmp_path / "cpu-ext")
    sources = tmp_path / "csrc"
    sources.mkdir()
    for path in build.CSRC.iterdir():
        (sources / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(build, "CSRC", sources)
    assert build.cache_dir() == first  # same content, same place: an existing build is reused
    (sources / "ops.h").write_text((sources / "ops.h").read_text() + "\n// changed\n")
    assert build.cache_dir() != first  # a changed source never loads a stale library
