"""The cuda backend's pieces that run without a GPU: vLLM's original cache layout (shapes, the reference
cache write, conversions), the Triton prefill kernel reading that layout, the V1/V2 choice, and
the backend's and the build's error messages.

The prefill runs under TRITON_INTERPRET=1 on the CPU (set by conftest.py) against the torch
backend: caches are filled through the reference write, every slot no sequence owns holds NaN, and
the output is NaN-poisoned, so a wrong index or an unwritten row fails loudly.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton", reason="the prefill kernel needs the triton package")

from pagedllm.attention.backends import get_attn_backend
from pagedllm.attention.backends.cuda_backend import CudaAttentionBackend
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend, write_to_paged_cache
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.cuda import build, use_v1
from pagedllm.kernels.cuda.layout import (
    cache_x,
    from_triton_layout,
    kv_cache_shape,
    reshape_and_cache_reference,
    to_triton_layout,
)
from pagedllm.kernels.triton import paged_prefill
from pagedllm.kernels.triton.paged_tiles import PagedKVLayout

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 4e-3)}


def test_x_is_sixteen_bytes_and_shapes_keep_block_first() -> None:
    assert [cache_x(d) for d in (torch.float16, torch.bfloat16, torch.float32)] == [8, 8, 4]
    assert kv_cache_shape(10, 16, 8, 128, torch.bfloat16) == ((10, 8, 16, 16, 8), (10, 8, 128, 16))
    assert CudaAttentionBackend.get_kv_cache_shape(7, 32, 2, 80, torch.float32) == (
        (7, 2, 20, 32, 4),
        (7, 2, 80, 32),
    )
    with pytest.raises(ValueError, match="multiple of x"):
        kv_cache_shape(1, 16, 1, 20, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_write_follows_the_seeds_index_math(dtype: torch.dtype) -> None:
    """vLLM's reshape_and_cache targets, element by element, as flat cache offsets."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_size, num_tokens = 6, 8, 3, 32, 11
    x = cache_x(dtype)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[[3, 9]] = -1  # padding
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    key_shape, value_shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, dtype)
    key_cache = torch.full(key_shape, float("nan"), dtype=dtype)
    value_cache = torch.full(value_shape, float("nan"), dtype=dtype)

    reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping)

    expected_key = torch.full((key_cache.numel(),), float("nan"), dtype=dtype)
    expected_value = torch.full((value_cache.numel(),), float("nan"), dtype=dtype)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block_idx, block_offset = divmod(slot, block_size)
        for head_idx in range(num_kv_heads):
            for head_offset in range(head_size):
                x_idx, x_offset = divmod(head_offset, x)
                tgt_key_idx = (
                    block_idx * num_kv_heads * (head_size // x) * block_size * x
                    + head_idx * (head_size // x) * block_size * x
                    + x_idx * block_size * x
                    + block_offset * x
                    + x_offset
                )
                tgt_value_idx = (
                    block_idx * num_kv_heads * head_size * block_size
                    + head_idx * head_size * block_size
                    + head_offset * block_size
                    + block_offset
                )
                expected_key[tgt_key_idx] = key[t, head_idx, head_offset]
                expected_value[tgt_value_idx] = value[t, head_idx, head_offset]
    torch.testing.assert_close(key_cache.flatten(), expected_key, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(value_cache.flatten(), expected_value, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_conversions_agree_with_the_writes(dtype: torch.dtype) -> None:
    """The torch backend's write, seen through from_triton_layout, is the reference write; and
    to_triton_layout undoes from_triton_layout."""
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_size = 5, 16, 2, 64
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:37]
    key = torch.randn(37, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(37, num_kv_heads, head_size, generator=gen).to(dtype)
    torch_shape = (num_blocks, block_size, num_kv_heads, head_size)
    torch_caches = [torch.zeros(torch_shape, dtype=dtype) for _ in range(2)]
    write_to_paged_cache(key, value, *torch_caches, slot_mapping)
    seeds_caches = [torch.zeros(s, dtype=dtype) for s in kv_cache_shape(*torch_shape[:2], 2, 64, dtype)]
    reshape_and_cache_reference(key, value, *seeds_caches, slot_mapping)

    converted = from_triton_layout(*(c.transpose(1, 2) for c in torch_caches))
    for got, want in zip(converted, seeds_caches):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    for got, want in zip(to_triton_layout(*seeds_caches), torch_caches):
        torch.testing.assert_close(got, want.transpose(1, 2), atol=0, rtol=0)


def test_paged_kv_layout_addresses_every_element() -> None:
    """PagedKVLayout's formula finds element (b, h, s, d) of vLLM's original caches in their storage."""
    gen = torch.Generator().manual_seed(2)
    triton_caches = [torch.randn(4, 3, 8, 32, generator=gen) for _ in range(2)]
    key_cache, value_cache = from_triton_layout(*triton_caches)
    layout = PagedKVLayout.of(key_cache, value_cache)
    assert (layout.num_kv_heads, layout.block_size, layout.head_size, layout.key_chunk) == (3, 8, 32, 4)
    b, h, s, d = torch.meshgrid(*(torch.arange(n) for n in (4, 3, 8, 32)), indexing="ij")
    kb, kh, ks, kc, kd = layout.key_strides
    vb, vh, vs, vd = layout.value_strides
    key_offsets = b * kb + h * kh + s * ks + (d // layout.key_chunk) * kc + (d % layout.key_chunk) * kd
    value_offsets = b * vb + h * vh + s * vs + d * vd
    assert torch.equal(key_cache.flatten()[key_offsets], triton_caches[0])
    assert torch.equal(value_cache.flatten()[value_offsets], triton_caches[1])


@dataclass
class Step:
    """One step's inputs, its context already cached in both vLLM's original layout (for the kernel)
    and the torch layout (for the oracle); NaN in every slot no sequence owns."""

    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_size]: the step's new tokens
    value: torch.Tensor
    seeds_caches: tuple[torch.Tensor, torch.Tensor]
    torch_caches: tuple[torch.Tensor, torch.Tensor]
    md: AttentionMetadata

    @property
    def num_real_tokens(self) -> int:
        return int(self.md.query_start_loc_cpu[-1])


def make_step(
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
) -> Step:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    for i, blocks in enumerate(perm[: sum(blocks_per_seq)].split(blocks_per_seq)):
        block_tables[i, : len(blocks)] = blocks

    def slots(i: int, start: int, stop: int) -> torch.Tensor:
        pos = torch.arange(start, stop)
        return block_tables[i, pos // block_size].long() * block_size + pos % block_size

    def rand(num_tokens: int, heads: int) -> torch.Tensor:
        return torch.randn(num_tokens, heads, head_size, generator=gen).to(dtype)

    context_slots = torch.cat([slots(i, 0, c) for i, c in enumerate(context_lens)])
    context_key, context_value = (
        rand(len(context_slots), num_kv_heads),
        rand(len(context_slots), num_kv_heads),
    )
    seeds_caches = tuple(
        torch.full(shape, float("nan"), dtype=dtype)
        for shape in kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, dtype)
    )
    reshape_and_cache_reference(context_key, context_value, *seeds_caches, context_slots)
    torch_shape = (num_blocks, block_size, num_kv_heads, head_size)
    torch_caches = tuple(torch.full(torch_shape, float("nan"), dtype=dtype) for _ in range(2))
    write_to_paged_cache(context_key, context_value, *torch_caches, context_slots)

    slot_mapping = torch.cat(
        [slots(i, c, c + q) for i, (c, q) in enumerate(zip(context_lens, query_lens))]
        + [torch.full((num_padding_tokens,), -1, dtype=torch.int64)]
    )
    num_tokens = len(slot_mapping)
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
    query, key, value = (
        rand(num_tokens, heads).to(DEVICE) for heads in (num_heads, num_kv_heads, num_kv_heads)
    )
    return Step(
        query,
        key,
        value,
        tuple(c.to(DEVICE) for c in seeds_caches),
        tuple(c.to(DEVICE) for c in torch_caches),
        md,
    )


def oracle(step: Step, num_heads: int, num_kv_heads: int, head_size: int, **variants: object) -> torch.Tensor:
    backend = TorchAttentionBackend(num_heads, head_size, head_size**-0.5, num_kv_heads, **variants)
    return backend.forward(step.query, step.key, step.value, step.torch_caches, step.md)


def run_prefill(step: Step, head_size: int, **variants: object) -> torch.Tensor:
    """The reference cache write of the step's K/V, then the prefill kernel into a NaN output."""
    md = step.md
    reshape_and_cache_reference(step.key, step.value, *step.seeds_caches, md.slot_mapping)
    out = torch.full_like(step.query, float("nan"))
    paged_prefill(
        step.query,
        *step.seeds_caches,
        md.block_tables,
        md.seq_lens,
        md.query_start_loc,
        head_size**-0.5,
        md.num_decodes,
        md.num_prefills,
        md.max_query_len,
        out,
        block_m=16,
        block_n=16,
        **variants,
    )
    return out


# (num_heads, num_kv_heads, head_size, block_size, dtype): MHA, GQA 2/4/8 and MQA; every head size
# of the CUDA kernels and every block size; float32 and float16 (the interpreter has no bfloat16).
CASES = [
    (4, 4, 64, 16, torch.float32),
    (8, 2, 64, 8, torch.float32),
    (16, 2, 128, 32, torch.float32),
    (8, 1, 80, 16, torch.float32),
    (4, 2, 96, 8, torch.float32),
    (2, 1, 112, 32, torch.float32),
    (4, 2, 256, 16, torch.float32),
    (8, 2, 80, 16, torch.float16),
    (8, 1, 128, 32, torch.float16),
    (4, 2, 64, 8, torch.float16),
]


def _case_id(case: tuple) -> str:
    num_heads, num_kv_heads, head_size, block_size, dtype = case
    return f"h{num_heads}-kv{num_kv_heads}-d{head_size}-b{block_size}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_prefill_over_the_seeds_layout_matches_torch(case: tuple) -> None:
    num_heads, num_kv_heads, head_size, block_size, dtype = case
    # Two decodes the prefill must leave alone, then: a fresh prompt over several query tiles,
    # chunks after a cached prefix (prefix caching, chunked prefill) starting and ending mid-block,
    # a one-token chunk; then CUDA-graph padding tokens.
    context_lens = [9, 30, 0, 21, 16, 45]
    query_lens = [1, 1, 37, 5, 16, 1]
    step = make_step(
        2,
        context_lens,
        query_lens,
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        dtype,
        num_padding_tokens=3,
    )
    ref = oracle(step, num_heads, num_kv_heads, head_size)
    out = run_prefill(step, head_size)
    assert out[:2].isnan().all(), "the prefill wrote the decodes' rows"
    prefill_rows = slice(2, step.num_real_tokens)
    assert not out[prefill_rows].isnan().any(), "prefill rows left unwritten (or NaN read from the cache)"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out[prefill_rows].float(), ref[prefill_rows].float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("seed", range(3))
def test_random_ragged_prefill_chunks(seed: int) -> None:
    rng = torch.Generator().manual_seed(seed)

    def pick(options: list) -> object:
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    num_kv_heads = pick([1, 2])
    num_heads = num_kv_heads * pick([1, 4, 8])
    head_size, block_size = pick([64, 96, 112, 128]), pick([8, 16, 32])
    context_lens = torch.randint(0, 90, (4,), generator=rng).tolist()
    query_lens = torch.randint(1, 40, (4,), generator=rng).tolist()
    step = make_step(
        0, context_lens, query_lens, num_heads, num_kv_heads, head_size, block_size, torch.float32, seed=seed
    )
    ref = oracle(step, num_heads, num_kv_heads, head_size)
    out = run_prefill(step, head_size)[: step.num_real_tokens]
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref[: step.num_real_tokens], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "variants",
    [{"sliding_window": 7}, {"sliding_window": 24, "logits_soft_cap": 3.0}, {"logits_soft_cap": 2.0}],
    ids=["window7", "window24-softcap", "softcap"],
)
def test_windowed_decode_rows_over_the_seeds_layout(variants: dict) -> None:
    """The cuda backend decodes a windowed or soft-capped layer with paged_prefill, one query per
    sequence (query_len 1, first_seq 0): the same kernel on vLLM's original layout, checked here."""
    context_lens = [0, 9, 30, 47, 70]
    step = make_step(5, context_lens, [1] * 5, 8, 2, 64, 16, torch.float32)
    ref = oracle(step, 8, 2, 64, **variants)
    out = run_prefill(
        dataclasses.replace(step, md=dataclasses.replace(step.md, num_decodes=0, num_prefills=5)),
        64,
        **variants,
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "max_seq_len, num_seqs, num_heads, expected",
    [
        (512, 1, 1, True),  # one partition: V2 would only add its reduce
        (513, 16, 32, False),  # two partitions, 512 (seq, head) blocks: not more than 512
        (513, 17, 32, True),
        (4096, 4, 32, False),  # few blocks, long contexts: split them
        (8192, 64, 32, True),  # K1
        (8193, 64, 32, False),  # past V1's bound
    ],
)
def test_v1_or_v2(max_seq_len: int, num_seqs: int, num_heads: int, expected: bool) -> None:
    assert use_v1(max_seq_len, num_seqs, num_heads) is expected


@pytest.mark.parametrize(
    "head_size, block_size, dtype, device, match",
    [
        (192, 16, torch.float16, "cuda", "head_size"),
        (128, 64, torch.float16, "cuda", "block_size"),
        (128, 16, torch.float64, "cuda", "dtype"),
        (128, 16, torch.bfloat16, "cpu", "CUDA device"),
    ],
)
def test_check_supported_names_what_is_unsupported(
    head_size: int, block_size: int, dtype: torch.dtype, device: str, match: str
) -> None:
    assert get_attn_backend("cuda", torch.device(device)) is CudaAttentionBackend
    with pytest.raises(ValueError, match=match):
        CudaAttentionBackend.check_supported(head_size, block_size, dtype, torch.device(device))


def test_build_names_what_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(RuntimeError, match="CUDA build of PyTorch"):
        build.check_build_requirements()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        build.check_build_requirements()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "an old GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (7, 5))
    with pytest.raises(RuntimeError, match=r"compute capability 8\.0"):
        build.check_build_requirements()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    with pytest.raises(RuntimeError, match="nvcc"):
        build.check_build_requirements()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").touch()
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(RuntimeError, match="ninja"):
        build.check_build_requirements()


def test_build_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    assert build.cache_dir().parent == tmp_path / "cuda-ext"
    monkeypatch.delenv("PAGEDLLM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_dir().parent == tmp_path / "xdg" / "pagedllm" / "cuda-ext"
