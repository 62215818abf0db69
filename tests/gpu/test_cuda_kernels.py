"""The CUDA kernels and the cuda backend on the GPU, against the torch backend.

reshape_and_cache, PagedAttention V1 and V2 over the supported grid (dtype {fp16, bf16, fp32} x head
size {64, 80, 96, 112, 128, 256} x block size {8, 16, 32}) on ragged batches with GQA; ALiBi against
a torch reference with slopes; V1 and V2 on contexts spanning many partitions (and V1 past the
default 48 KB of shared memory); the backend's forward on a mixed decode + prefill batch, and a
decode step replayed in a CUDA graph. Caches hold NaN in every slot no sequence owns and outputs are
NaN before each run, so a wrong index, a read past seq_len or an unwritten row fails loudly.
The first test to run builds the extension (under a minute; cached afterwards).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA (and compiled Triton for the backend's prefill)", allow_module_level=True)

from pagedllm.attention.backends import get_attn_backend
from pagedllm.attention.backends.cuda_backend import CudaAttentionBackend
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend, gather_context
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.cuda import build, ops
from pagedllm.kernels.cuda.layout import from_triton_layout, kv_cache_shape, reshape_and_cache_reference

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}
GRID = [
    (dtype, head_size, block_size)
    for dtype in ops.SUPPORTED_DTYPES
    for head_size in ops.SUPPORTED_HEAD_SIZES
    for block_size in ops.SUPPORTED_BLOCK_SIZES
]
KERNELS = {"v1": ops.paged_attention_v1, "v2": ops.paged_attention_v2}
K1 = {"num_heads": 32, "num_kv_heads": 8, "head_size": 128, "block_size": 16, "dtype": torch.bfloat16}


def _grid_id(case: tuple) -> str:
    dtype, head_size, block_size = case
    return f"{str(dtype).removeprefix('torch.')}-d{head_size}-b{block_size}"


@dataclass
class Batch:
    """A step's inputs with each sequence's first ``filled_len`` tokens already cached, in vLLM's original
    layout (for the kernels) and the torch layout (for the oracle); NaN in every other slot."""

    query: torch.Tensor  # [num_tokens, num_heads, head_size], a view of a fused QKV projection
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_size], the same
    value: torch.Tensor
    caches: tuple[torch.Tensor, torch.Tensor]  # vLLM's original layout
    torch_caches: tuple[torch.Tensor, torch.Tensor]  # [num_blocks, block_size, num_kv_heads, head_size]
    md: AttentionMetadata
    num_heads: int
    num_kv_heads: int
    head_size: int

    @property
    def scale(self) -> float:
        return self.head_size**-0.5

    @property
    def num_real_tokens(self) -> int:
        return int(self.md.query_start_loc_cpu[-1])

    def oracle(self) -> torch.Tensor:
        """The torch backend's output (it writes this step's K/V into its own caches first)."""
        backend = TorchAttentionBackend(self.num_heads, self.head_size, self.scale, self.num_kv_heads)
        return backend.forward(self.query, self.key, self.value, self.torch_caches, self.md)


def make_batch(
    seq_lens: list[int],
    query_lens: list[int],
    num_decodes: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    max_seq_len: int | None = None,
    num_padding_tokens: int = 0,
    fill_new_tokens: bool = False,
    seed: int = 0,
) -> Batch:
    """Sequence i has seq_lens[i] tokens, the last query_lens[i] of them new this step. With
    ``fill_new_tokens`` the new tokens' K/V are cached already and slot_mapping is all padding (-1):
    the kernels' inputs, without a cache write. ``max_seq_len`` is the host bound (default: tight)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 4
    perm = torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32, device=DEVICE)
    filled = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=DEVICE)
    slots = []
    for i, blocks in enumerate(perm[: sum(blocks_per_seq)].split(blocks_per_seq)):
        block_tables[i, : len(blocks)] = blocks
        pos = torch.arange(seq_lens[i], device=DEVICE)
        seq_slots = blocks[pos // block_size].long() * block_size + pos % block_size
        num_filled = seq_lens[i] if fill_new_tokens else seq_lens[i] - query_lens[i]
        filled.view(-1)[seq_slots[:num_filled]] = True
        slots.append(seq_slots[seq_lens[i] - query_lens[i] :])
    slot_mapping = torch.cat([*slots, torch.full((num_padding_tokens,), -1, device=DEVICE)])
    if fill_new_tokens:
        slot_mapping.fill_(-1)

    # Random blocks in the Triton layout [num_blocks, num_kv_heads, block_size, head_size], NaN in
    # every slot not filled, then the same data in the two layouts the test compares.
    triton_caches = []
    for _ in range(2):
        cache = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=gen, device=DEVICE)
        triton_caches.append(cache.to(dtype).masked_fill_(~filled[:, None, :, None], float("nan")))
    caches = from_triton_layout(*triton_caches)
    torch_caches = tuple(c.transpose(1, 2).contiguous() for c in triton_caches)

    num_tokens = len(slot_mapping)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=gen, device=DEVICE)
    query, key, value = qkv.to(dtype).split([num_heads * head_size, *[num_kv_heads * head_size] * 2], dim=1)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    md = AttentionMetadata(
        num_decodes=num_decodes,
        num_prefills=len(seq_lens) - num_decodes,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=seq_lens_cpu.to(DEVICE),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max_seq_len or max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_cpu,
    )
    return Batch(
        query.view(num_tokens, num_heads, head_size),
        key.view(num_tokens, num_kv_heads, head_size),
        value.view(num_tokens, num_kv_heads, head_size),
        caches,
        torch_caches,
        md,
        num_heads,
        num_kv_heads,
        head_size,
    )


def make_decode_batch(seq_lens: list[int], max_seq_len: int | None = None, **shape) -> Batch:
    """Decodes only, their whole contexts cached: the attention kernels' inputs."""
    n = len(seq_lens)
    return make_batch(seq_lens, [1] * n, n, max_seq_len=max_seq_len, fill_new_tokens=True, **shape)


def run_kernel(version: str, batch: Batch, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    md = batch.md
    out = torch.full_like(batch.query, float("nan"))
    KERNELS[version](
        batch.query,
        *batch.caches,
        md.block_tables,
        md.seq_lens,
        batch.scale,
        md.max_seq_len,
        out,
        alibi_slopes,
    )
    torch.cuda.synchronize()
    return out


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements never written (or NaN)"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def ragged_lens(block_size: int, seed: int) -> list[int]:
    """One token, both sides of a block boundary, and random lengths spanning several V2 partitions."""
    gen = torch.Generator().manual_seed(seed)
    return [
        1,
        block_size - 1,
        block_size,
        block_size + 1,
        *torch.randint(2, 1600, (4,), generator=gen).tolist(),
    ]


def test_extension_partition_size_is_pythons() -> None:
    assert build.load().PARTITION_SIZE == ops.PARTITION_SIZE


@pytest.mark.parametrize("case", GRID, ids=_grid_id)
def test_reshape_and_cache_matches_the_reference(case: tuple) -> None:
    dtype, head_size, block_size = case
    num_kv_heads, num_blocks, num_tokens = 3, 9, 40
    gen = torch.Generator(device=DEVICE).manual_seed(head_size + block_size)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:num_tokens]
    slot_mapping[::7] = -1  # padding tokens: never written
    # K and V as views of one fused projection output, as the attention layer passes them.
    kv = torch.randn(num_tokens, 2 * num_kv_heads * head_size, generator=gen, device=DEVICE).to(dtype)
    key, value = (t.view(num_tokens, num_kv_heads, head_size) for t in kv.chunk(2, dim=1))
    shapes = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, dtype)
    caches = [torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for shape in shapes]
    expected = [cache.clone() for cache in caches]

    ops.reshape_and_cache(key, value, *caches, slot_mapping)
    reshape_and_cache_reference(key, value, *expected, slot_mapping)

    for got, want in zip(caches, expected):
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("version", list(KERNELS))
@pytest.mark.parametrize("case", GRID, ids=_grid_id)
def test_attention_matches_torch(version: str, case: tuple) -> None:
    dtype, head_size, block_size = case
    seq_lens = ragged_lens(block_size, seed=head_size)
    # A host bound above every length, as under CUDA graphs: V2's extra partitions must exit.
    batch = make_decode_batch(
        seq_lens,
        max_seq_len=max(seq_lens) + 300,
        num_heads=8,
        num_kv_heads=2,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
    )
    assert_matches(run_kernel(version, batch), batch.oracle(), dtype)


@pytest.mark.parametrize("version", list(KERNELS))
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 1), (12, 3), (32, 8)])
def test_attention_head_groupings(version: str, num_heads: int, num_kv_heads: int) -> None:
    """MHA, MQA and GQA groups of 4: query head h reads KV head h // group."""
    shape = {**K1, "num_heads": num_heads, "num_kv_heads": num_kv_heads}
    batch = make_decode_batch(ragged_lens(16, seed=num_heads), **shape)
    assert_matches(run_kernel(version, batch), batch.oracle(), torch.bfloat16)


@pytest.mark.parametrize("version", list(KERNELS))
def test_long_contexts_span_many_partitions(version: str) -> None:
    """V2 over up to 40 partitions; V1 at 20000 tokens keeps 80 KB of logits in shared memory (past
    the default 48 KB: the launcher raises the kernel's limit)."""
    batch = make_decode_batch([20000, 8193, 4096, 513, 512, 1], **K1)
    assert_matches(run_kernel(version, batch), batch.oracle(), torch.bfloat16)


def alibi_reference(batch: Batch, slopes: torch.Tensor) -> torch.Tensor:
    """Decode attention with the ALiBi bias slope_h * (key position - query position), in float32."""
    key_cache, value_cache = batch.torch_caches
    group = batch.num_heads // batch.num_kv_heads
    outs = []
    for i, seq_len in enumerate(batch.md.seq_lens_cpu.tolist()):
        table = batch.md.block_tables[i]
        keys = gather_context(key_cache, table, seq_len).float().repeat_interleave(group, dim=1)
        values = gather_context(value_cache, table, seq_len).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", batch.query[i].float(), keys) * batch.scale
        distance = torch.arange(seq_len, device=DEVICE) - (seq_len - 1)
        probs = torch.softmax(scores + slopes[:, None] * distance[None, :], dim=-1)
        outs.append(torch.einsum("hl,lhd->hd", probs, values))
    return torch.stack(outs)


@pytest.mark.parametrize("version", list(KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alibi_matches_a_torch_reference(version: str, dtype: torch.dtype) -> None:
    batch = make_decode_batch(
        ragged_lens(16, seed=7), **{**K1, "num_heads": 8, "num_kv_heads": 2, "dtype": dtype}
    )
    # The ALiBi paper's geometric slopes for 8 heads: 2^-1, 2^-2, ..., 2^-8.
    slopes = torch.pow(2.0, -torch.arange(1, 9, dtype=torch.float32, device=DEVICE))
    out = run_kernel(version, batch, alibi_slopes=slopes)
    ref = alibi_reference(batch, slopes)
    assert_matches(out, ref, dtype)
    # The bias matters: without it the outputs differ.
    assert not torch.allclose(run_kernel(version, batch).float(), ref, atol=1e-2)


def test_paged_attention_runs_the_version_use_v1_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_decode_batch(ragged_lens(16, seed=3), **K1)
    md = batch.md
    ran = []
    extension = ops.load()

    class Recording:
        """The built extension, noting which paged_attention_<version> each call runs."""

        def __getattr__(self, name: str):
            kernel = getattr(extension, name)

            def run(*args: object, **kwargs: object) -> object:
                ran.append(name.rpartition("_")[2])
                return kernel(*args, **kwargs)

            return run

    monkeypatch.setattr(ops, "load", Recording)
    for version, v1 in (("v1", True), ("v2", False)):
        monkeypatch.setattr(ops, "use_v1", lambda *_, v1=v1: v1)
        out = torch.full_like(batch.query, float("nan"))
        ops.paged_attention(
            batch.query, *batch.caches, md.block_tables, md.seq_lens, batch.scale, md.max_seq_len, out
        )
        assert ran[-1] == version
        assert_matches(out, batch.oracle(), torch.bfloat16)


@pytest.mark.parametrize("dtype", ops.SUPPORTED_DTYPES)
def test_backend_forward_on_a_mixed_batch(dtype: torch.dtype) -> None:
    """Decodes, then prefill chunks (a fresh prompt, chunks after cached prefixes), then CUDA-graph
    padding tokens: the cache write, V1/V2 and the Triton prefill over vLLM's original layout."""
    gen = torch.Generator().manual_seed(5)
    num_decodes = 12
    context_lens = torch.randint(0, 3000, (num_decodes + 3,), generator=gen).tolist()
    query_lens = [1] * num_decodes + [300, 77, 1]
    context_lens[num_decodes] = 0
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    batch = make_batch(seq_lens, query_lens, num_decodes, 8, 2, 128, 16, dtype, num_padding_tokens=5)
    backend_cls = get_attn_backend("cuda", DEVICE)
    assert backend_cls is CudaAttentionBackend
    backend_cls.check_supported(128, 16, dtype, DEVICE)
    backend = backend_cls(8, 128, batch.scale, 2)
    out = backend.forward(batch.query, batch.key, batch.value, batch.caches, batch.md)
    torch.cuda.synchronize()
    assert out.shape == batch.query.shape and out.dtype == dtype
    n = batch.num_real_tokens
    assert_matches(out[:n], batch.oracle()[:n], dtype)


def test_decode_replays_in_a_cuda_graph() -> None:
    """Nothing in forward syncs and V2's partitions come from the host bound: capture a decode step
    at short lengths, replay it after writing longer lengths and real slots into the same tensors."""
    seq_lens = [100 + 211 * i for i in range(16)]
    batch = make_batch(seq_lens, [1] * 16, 16, max_seq_len=4096, **K1)
    assert not ops.use_v1(4096, 16, K1["num_heads"]), "meant to capture V2 with its workspace"
    ref = batch.oracle()
    final_seq_lens, final_slots = batch.md.seq_lens.clone(), batch.md.slot_mapping.clone()
    batch.md.seq_lens.fill_(100)
    batch.md.slot_mapping.fill_(-1)  # the warm-up and capture must not write the cache
    backend = CudaAttentionBackend(K1["num_heads"], 128, batch.scale, K1["num_kv_heads"])

    def forward() -> torch.Tensor:
        return backend.forward(batch.query, batch.key, batch.value, batch.caches, batch.md)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # builds and loads the extension outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = forward()

    batch.md.seq_lens.copy_(final_seq_lens)
    batch.md.slot_mapping.copy_(final_slots)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(graph_out, ref, torch.bfloat16)


def test_errors_name_the_problem() -> None:
    batch = make_decode_batch([40, 7], **K1)
    md, out = batch.md, torch.empty_like(batch.query)
    args = (batch.query, *batch.caches, md.block_tables, md.seq_lens, batch.scale)
    with pytest.raises(RuntimeError, match="block_tables"):
        ops.paged_attention_v1(batch.query, *batch.caches, md.block_tables.long(), md.seq_lens, 1.0, 40, out)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.paged_attention_v2(*args, 40, out.float())
    with pytest.raises(ValueError, match="use paged_attention_v2"):
        ops.paged_attention_v1(*args, 1_000_000, out)
    shapes = kv_cache_shape(4, 16, 8, 192, torch.bfloat16)
    caches = [torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE) for shape in shapes]
    query = torch.zeros(2, 32, 192, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="head_size 192"):
        ops.paged_attention_v1(query, *caches, md.block_tables, md.seq_lens, 1.0, 40, torch.empty_like(query))
