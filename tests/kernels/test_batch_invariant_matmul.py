"""The batch-invariant GEMM (kernels/triton/batch_invariant_matmul.py): a row's output is the same
bits whatever the other rows (how many, which, in what order) and whichever schedule ran the K
splits, and it matches torch's matmul within rounding (run on the CPU under TRITON_INTERPRET=1 at
tiny shapes; on CUDA as well when there is one)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.triton.batch_invariant_matmul import (
    LONG_K_TILES,
    TILES,
    arrival_counters,
    batch_invariant_matmul,
    num_k_splits,
    tiles_for,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter does bfloat16 arithmetic on the raw bit patterns (tests/kernels/
# test_triton_attention.py): bfloat16 runs on the GPU only, float16 everywhere.
NEEDS_GPU = pytest.mark.skipif(DEVICE == "cpu", reason="Triton's interpreter has no bfloat16")
BF16 = pytest.param(torch.bfloat16, marks=NEEDS_GPU)
# N spans a partial output tile; K five K tiles, cut by 2 splits into ranges of 3 and 2 tiles.
N, K = 200, 320


def _inputs(dtype: torch.dtype, rows: int = 70) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, K, generator=generator)
    weight = torch.randn(N, K, generator=generator) / K**0.5
    bias = torch.randn(N, generator=generator)
    return x.to(DEVICE, dtype), weight.to(DEVICE, dtype), bias.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("split_in_grid", [False, True])
@pytest.mark.parametrize("layer_k", [1024, 4096], ids=["tiles", "long-k-tiles"])
def test_rows_are_the_same_bits_whatever_the_batch(
    dtype: torch.dtype, split_in_grid: bool, layer_k: int
) -> None:
    """With the tiles a layer of ``layer_k`` inputs gets (on this device, at this dtype)."""
    tiles = tiles_for(layer_k, torch.device(DEVICE), dtype.itemsize)
    x, weight, bias = _inputs(dtype)

    def matmul(rows: torch.Tensor, in_grid: bool = split_in_grid) -> torch.Tensor:
        return batch_invariant_matmul(rows, weight, bias, 2, tiles, split_in_grid=in_grid)

    full = matmul(x)
    for m in (1, 3, 65):
        assert torch.equal(matmul(x[:m]), full[:m])
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert torch.equal(matmul(x[order]), full[order])
    # The other schedule sums the same ranges in the same order.
    assert torch.equal(matmul(x, not split_in_grid), full)


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.float32, 1e-5), (torch.float16, 4e-3), pytest.param(torch.bfloat16, 2e-2, marks=NEEDS_GPU)],
)
@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_matches_torch_matmul(dtype: torch.dtype, tolerance: float, num_splits: int) -> None:
    x, weight, bias = _inputs(dtype, rows=9)
    reference = x.double() @ weight.double().t() + bias.double()
    for with_bias in (True, False):
        out = batch_invariant_matmul(x, weight, bias if with_bias else None, num_splits, split_in_grid=True)
        expected = reference if with_bias else reference - bias.double()
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


def test_split_in_grid_leaves_every_arrival_counter_at_zero() -> None:
    """The last program of a tile to arrive resets its counter: the next call (or a CUDA graph's
    replay of this one) starts from zero, and its sums are the same."""
    x, weight, bias = _inputs(torch.float32, rows=70)  # 2 x 2 tiles
    first = batch_invariant_matmul(x, weight, bias, 5, split_in_grid=True)
    counters = arrival_counters(x.device, 4)
    assert counters.numel() >= 4 and not counters.any()
    assert torch.equal(batch_invariant_matmul(x, weight, bias, 5, split_in_grid=True), first)
    assert not counters.any()


def test_tiles_depend_on_the_layers_k_only() -> None:
    cpu = torch.device("cpu")
    assert tiles_for(1024, cpu) == tiles_for(3072, cpu) == TILES  # Qwen3-0.6B's layers
    assert tiles_for(4096, cpu) == tiles_for(14336, cpu) == LONG_K_TILES  # Llama-3.1-8B's
    assert LONG_K_TILES.block_k == 2 * TILES.block_k
    # Their pipeline's buffers at 16 bits: what Hopper's 227 KiB of shared memory holds, Ampere's
    # 163 KiB does not (tiles_for falls back to TILES there).
    assert LONG_K_TILES.shared_memory_bytes(2) == 192 * 1024
    assert LONG_K_TILES.shared_memory_bytes(4) == 384 * 1024  # float32: more than any GPU's


@pytest.mark.skipif(DEVICE == "cpu", reason="the GPU's shared memory")
def test_long_k_tiles_fit_this_gpu_or_are_not_chosen() -> None:
    device = torch.device(DEVICE)
    limit = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    assert tiles_for(4096, device, 4) == TILES
    tiles = tiles_for(4096, device)
    assert tiles.shared_memory_bytes(2) <= limit
    x, weight, bias = (t.bfloat16() for t in _inputs(torch.float32))
    out = batch_invariant_matmul(x, weight, bias, 2, tiles)
    torch.testing.assert_close(
        out.float(), x.float() @ weight.float().t() + bias.float(), atol=2e-2, rtol=2e-2
    )


def test_split_count_depends_on_the_layer_and_the_gpu_only() -> None:
    # Qwen3-0.6B on an H100 (132 SMs): qkv (4096 x 1024), o_proj (1024 x 2048), down (1024 x 3072), LM head.
    assert num_k_splits(4096, 1024, 132) == 1  # 32 tiles want 4 splits; 16 K tiles allow 1
    assert num_k_splits(1024, 2048, 132) == 2  # 8 tiles want 16; 32 K tiles allow 2
    assert num_k_splits(1024, 3072, 132) == 3
    assert num_k_splits(151936, 1024, 132) == 1
    # Llama-3.1-8B: qkv (6144 x 4096), o_proj (4096 x 4096), gate_up (28672 x 4096), down (4096 x 14336).
    assert num_k_splits(6144, 4096, 132) == 3  # 48 tiles want 2.75 -> 3
    assert num_k_splits(4096, 4096, 132) == 4
    assert num_k_splits(28672, 4096, 132) == 1
    assert num_k_splits(4096, 14336, 132) == 4
    # The same layer on a GPU of 78 SMs.
    assert num_k_splits(4096, 14336, 78) == 2
    # With the long-K tiles (Llama-3.1-8B's): half as many K tiles allow fewer splits.
    assert num_k_splits(6144, 4096, 132, LONG_K_TILES) == 2
    assert num_k_splits(4096, 4096, 132, LONG_K_TILES) == 2
    assert num_k_splits(4096, 14336, 132, LONG_K_TILES) == 4


def test_use_batch_invariant_gemms_routes_dense_layers_and_a_tied_head() -> None:
    from torch import nn

    from pagedllm.layers.batch_invariant_linear import BatchInvariantLinearMethod, use_batch_invariant_gemms
    from pagedllm.layers.linear import QKVParallelLinear
    from pagedllm.layers.logits_processor import LogitsProcessor
    from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding

    generator = torch.Generator().manual_seed(2)
    model = nn.Module()
    model.qkv = QKVParallelLinear(64, 16, total_num_heads=4, total_num_kv_heads=2, bias=True)
    model.embed_tokens = VocabParallelEmbedding(150, 64)
    model.lm_head = model.embed_tokens  # tied
    for param in model.parameters():
        param.data = torch.randn(param.shape, generator=generator).to(DEVICE) / 8
    x = torch.randn(5, 64, generator=generator).to(DEVICE)
    ids = torch.tensor([0, 7, 149]).to(DEVICE)
    expected = (model.qkv(x), model.embed_tokens(ids), LogitsProcessor(150)(model.lm_head, x))

    use_batch_invariant_gemms(model, torch.device(DEVICE))
    assert isinstance(model.qkv.quant_method, BatchInvariantLinearMethod)
    got = (model.qkv(x), model.embed_tokens(ids), LogitsProcessor(150)(model.lm_head, x))
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1], expected[1])  # lookups read the table as before
    torch.testing.assert_close(got[2], expected[2], atol=1e-5, rtol=1e-5)
    assert torch.equal(model.qkv(x[:2]), got[0][:2])
