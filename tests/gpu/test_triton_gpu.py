"""The Triton attention backend on CUDA at realistic sizes, against the torch oracle.

The K1 shape (32 query heads, 8 KV heads, head 128, block 16, bf16, batch 64, context 4096) in
uniform and ragged batches, prefill chunks over cached prefixes, every supported head size and
dtype (which also checks that each configuration compiles and fits shared memory), and a decode
step captured in a CUDA graph and replayed with new lengths.
"""

from __future__ import annotations

import os

import pytest
import torch

# Skip before importing the kernels: triton decides compiled vs interpreted when a kernel is
# decorated, and tests/kernels needs them interpreted on a machine without CUDA.
if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton kernels", allow_module_level=True)
pytest.importorskip("triton", reason="the triton attention backend needs the triton package")

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.attention.backends.triton_backend import TritonAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


class Step:
    """One step's inputs, with cached context in a Triton-layout cache (NaN in unused slots)."""

    def __init__(
        self,
        context_lens: list[int],
        query_lens: list[int],
        num_decodes: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        dtype: torch.dtype,
        max_seq_len: int | None = None,
        num_padding_tokens: int = 0,
    ) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 8
        max_blocks = -(-(max_seq_len or max(seq_lens)) // block_size)
        perm = torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32)
        self.block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device=DEVICE)
        cache_shape = (num_blocks, num_kv_heads, block_size, head_size)
        self.key_cache = torch.randn(cache_shape, generator=gen, device=DEVICE).to(dtype)
        self.value_cache = torch.randn(cache_shape, generator=gen, device=DEVICE).to(dtype)
        used = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=DEVICE)
        slot_mapping, first = [], 0
        for i, (n, ctx, q) in enumerate(zip(blocks_per_seq, context_lens, query_lens)):
            blocks = perm[first : first + n]
            first += n
            self.block_tables[i, :n] = blocks
            used.view(-1)[_slots(blocks, range(seq_lens[i]), block_size)] = True
            slot_mapping.append(_slots(blocks, range(ctx, ctx + q), block_size))
        # Slots no sequence owns hold NaN: reading one poisons the output.
        for cache in (self.key_cache, self.value_cache):
            cache.masked_fill_(~used[:, None, :, None], float("nan"))
        slot_mapping.append(torch.full((num_padding_tokens,), -1, dtype=torch.int64, device=DEVICE))
        self.slot_mapping = torch.cat(slot_mapping)
        num_tokens = self.slot_mapping.shape[0]
        self.query = torch.randn(num_tokens, num_heads, head_size, generator=gen, device=DEVICE).to(dtype)
        self.key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen, device=DEVICE).to(dtype)
        self.value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen, device=DEVICE).to(dtype)
        query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        self.md = AttentionMetadata(
            num_decodes=num_decodes,
            num_prefills=len(seq_lens) - num_decodes,
            slot_mapping=self.slot_mapping,
            query_start_loc=query_start_loc.to(DEVICE),
            seq_lens=seq_lens_cpu.to(DEVICE),
            block_tables=self.block_tables,
            max_query_len=max(query_lens),
            max_seq_len=max_seq_len or max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens_cpu,
        )
        self.num_real_tokens = int(query_start_loc[-1])
        self.shape = (num_heads, head_size, num_kv_heads)

    def run(self, backend_cls: type, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        num_heads, head_size, num_kv_heads = self.shape
        backend = backend_cls(num_heads, head_size, head_size**-0.5, num_kv_heads)
        out = backend.forward(self.query, self.key, self.value, kv_cache, self.md)
        return out[: self.num_real_tokens]

    def oracle(self) -> torch.Tensor:
        """The torch backend on copies of the caches in its own layout."""
        caches = tuple(c.permute(0, 2, 1, 3).contiguous() for c in (self.key_cache, self.value_cache))
        return self.run(TorchAttentionBackend, caches)

    def triton(self) -> torch.Tensor:
        return self.run(TritonAttentionBackend, (self.key_cache, self.value_cache))


def _slots(blocks: torch.Tensor, positions: range, block_size: int) -> torch.Tensor:
    pos = torch.arange(positions.start, positions.stop, device=DEVICE)
    return blocks[pos // block_size].long() * block_size + pos % block_size


def assert_matches(step: Step, dtype: torch.dtype) -> None:
    ref = step.oracle()
    out = step.triton()
    torch.cuda.synchronize()
    assert not out.isnan().any(), f"{int(out.isnan().sum())} NaN outputs"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


K1 = {"num_heads": 32, "num_kv_heads": 8, "head_size": 128, "block_size": 16, "dtype": torch.bfloat16}


def test_decode_k1_uniform() -> None:
    assert_matches(Step([4095] * 64, [1] * 64, 64, **K1), torch.bfloat16)


def test_decode_k1_ragged_under_a_graph_bound() -> None:
    lens = torch.randint(0, 4096, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    assert_matches(Step(lens, [1] * 64, 64, max_seq_len=8192, **K1), torch.bfloat16)


def test_prefill_chunks_over_cached_prefixes() -> None:
    gen = torch.Generator().manual_seed(2)
    context_lens = [0, *torch.randint(0, 2048, (7,), generator=gen).tolist()]
    query_lens = [1024, *torch.randint(1, 700, (7,), generator=gen).tolist()]
    assert_matches(Step(context_lens, query_lens, 0, **K1), torch.bfloat16)


def test_mixed_batch_with_padding() -> None:
    gen = torch.Generator().manual_seed(3)
    context_lens = torch.randint(0, 3000, (52,), generator=gen).tolist()
    query_lens = [1] * 48 + [512, 77, 300, 1]
    assert_matches(Step(context_lens, query_lens, 48, num_padding_tokens=13, **K1), torch.bfloat16)


# Every head size and dtype at block 16, and the other block sizes once: each case compiles its
# own kernels, so the cross product would spend minutes compiling for little extra coverage.
CONFIGS = [
    *[
        (head_size, dtype, 16)
        for head_size in (64, 80, 96, 112, 128, 192, 256)
        for dtype in (torch.bfloat16, torch.float16, torch.float32)
    ],
    (128, torch.bfloat16, 8),
    (128, torch.bfloat16, 32),
    (80, torch.float16, 8),
]


@pytest.mark.parametrize("head_size, dtype, block_size", CONFIGS)
def test_every_supported_configuration(head_size: int, dtype: torch.dtype, block_size: int) -> None:
    TritonAttentionBackend.check_supported(head_size, block_size, dtype, DEVICE)
    gen = torch.Generator().manual_seed(head_size)
    context_lens = torch.randint(0, 1500, (10,), generator=gen).tolist()
    query_lens = [1] * 8 + [200, 33]
    step = Step(context_lens, query_lens, 8, 8, 2, head_size, block_size, dtype, max_seq_len=2048)
    assert_matches(step, dtype)


def test_decode_replays_in_a_cuda_graph() -> None:
    """Partitions come from the host bound and nothing syncs: capture a decode step at short
    lengths, then replay it after writing longer lengths and real slots into the same tensors."""
    step = Step([100 + 211 * i for i in range(16)], [1] * 16, 16, max_seq_len=4096, **K1)
    ref = step.oracle()
    final_seq_lens, final_slots = step.md.seq_lens.clone(), step.slot_mapping.clone()
    step.md.seq_lens.fill_(100)
    step.slot_mapping.fill_(-1)  # the warm-up run below must not write the cache
    backend = TritonAttentionBackend(32, 128, 128**-0.5, 8)

    def forward() -> torch.Tensor:
        return backend.forward(step.query, step.key, step.value, (step.key_cache, step.value_cache), step.md)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = forward()

    step.md.seq_lens.copy_(final_seq_lens)
    step.slot_mapping.copy_(final_slots)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(graph_out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_hopper_launches_the_step_kernels_with_programmatic_dependent_launch() -> None:
    """The test above and the engine's graph tests replay these launches; here: they are on where
    the device has PDL, so those tests cover the kernels' device-side waits."""
    from pagedllm.kernels.triton.pdl import pdl_options

    on = torch.cuda.get_device_capability()[0] >= 9
    assert pdl_options(torch.device("cuda", torch.cuda.current_device())) == {"USE_GDC": on, "launch_pdl": on}
