"""The batch-invariant GEMM (kernels/triton/batch_invariant_matmul.py): a row's output is the same
bits whatever the other rows (how many, which, in what order) and whichever schedule ran the K
splits, and it matches torch's matmul within rounding (run on the CPU under TRITON_INTERPRET=1 at
tiny shapes; on CUDA as well when there is one)."""

from __future__ import annotations

import pytest
import torch
import triton

from pagedllm.kernels.triton.batch_invariant_matmul import (
    FEW_ROWS_TILES,
    LONG_K_TILES,
    TILES,
    WIDE_SPLIT_STAGES,
    LayerGemm,
    MatmulTiles,
    batch_invariant_matmul,
    num_k_splits,
    tiles_for,
    wide_tiles,
)
from pagedllm.kernels.triton.split_k import arrival_counters, num_sms

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


@pytest.mark.parametrize("dtype", [torch.float16, BF16])
@pytest.mark.parametrize("layer_k", [1024, 4096], ids=["tiles", "long-k-tiles"])
def test_wide_tiles_give_the_same_bits_as_the_narrow(dtype: torch.dtype, layer_k: int) -> None:
    """The output tile decides only which program computes an element: with the layer's BLOCK_K
    and splits, the wide tiles, the few-rows tiles (N tiles of 64 and 32) and others give every
    row the same bits as the narrow ones, at row counts that cut both tiles anywhere and with
    either schedule of the narrow."""
    device = torch.device(DEVICE)
    tiles = tiles_for(layer_k, device, dtype.itemsize)
    wide = wide_tiles(tiles, device, dtype.itemsize)
    split_wide = wide_tiles(tiles, device, dtype.itemsize, num_splits=2)
    assert wide is not None and wide.block_k == split_wide.block_k == tiles.block_k
    few = list(FEW_ROWS_TILES[tiles.block_k].values())
    others = [wide, split_wide, MatmulTiles(128, 256, tiles.block_k, 8, 2), *few]
    x, weight, bias = _inputs(dtype, rows=160)
    for splits in (1, 2, 5):
        narrow = batch_invariant_matmul(x, weight, bias, splits, tiles, split_in_grid=True)
        assert torch.equal(
            batch_invariant_matmul(x, weight, bias, splits, tiles, split_in_grid=False), narrow
        )
        for other in others:
            for m in (1, 129, 160):
                out = batch_invariant_matmul(x[:m], weight, bias, splits, other)
                assert torch.equal(out, narrow[:m]), (other, splits, m)


def test_a_layer_takes_the_wide_tiles_from_a_share_of_the_sms() -> None:
    device = torch.device(DEVICE)
    gemm = LayerGemm.for_layer(N, K, device)  # 2 wide tiles a row block, BLOCK_K 64: half the SMs
    assert gemm.tiles == tiles_for(K, device)
    assert gemm.wide == wide_tiles(gemm.tiles, device, num_splits=gemm.num_splits)
    assert (gemm.wide.block_m, gemm.wide.block_n) == (128, 128)
    assert gemm.wide_from_rows == triton.cdiv(triton.cdiv(num_sms(device), 2), 2) * 128
    assert gemm.tiles_for_rows(gemm.wide_from_rows - 1) == gemm.tiles
    assert gemm.tiles_for_rows(gemm.wide_from_rows) == gemm.wide
    # On an H100's or H200's 132 SMs (bf16). Qwen3-0.6B (BLOCK_K 64, 66 wide tiles wanted): the LM
    # head's 1,187 a row block from one row block; qkv's 32 from 3; o_proj's 8 from 9.
    cpu = torch.device("cpu")
    assert LayerGemm.for_layer(151_936, 1024, cpu, sms=132).wide_from_rows == 128
    assert LayerGemm.for_layer(4096, 1024, cpu, sms=132).wide_from_rows == 384
    assert LayerGemm.for_layer(1024, 2048, cpu, sms=132).wide_from_rows == 1152
    assert LayerGemm.for_layer(1024, 2048, cpu, sms=132).num_splits == num_k_splits(1024, 2048, 132)
    # Llama-3.1-8B (BLOCK_K 128, 33 wanted): o_proj's 32 a row block from 2; qkv's 48 from 1.
    assert LayerGemm.for_layer(4096, 4096, cpu, sms=132).wide_from_rows == 256
    assert LayerGemm.for_layer(6144, 4096, cpu, sms=132).wide_from_rows == 128
    # Few rows: the narrowest N tiles whose programs (row blocks x N tiles x splits) make one wave.
    # Qwen3-0.6B's qkv (1 split): 128 programs of N tiles of 32 at 64 rows; at 128 rows 2 x 64 of 64.
    qkv = LayerGemm.for_layer(4096, 1024, cpu, sms=132)
    assert [qkv.tiles_for_rows(m).block_n for m in (1, 64, 65, 128, 129, 383)] == [32, 32, 64, 64, 128, 128]
    assert qkv.tiles_for_rows(1) == FEW_ROWS_TILES[64][32]
    # Llama-3.1-8B's o_proj (2 splits): 64 x 2 programs of 64 at one row; its down_proj (4 splits)
    # would make 256 with N tiles of 64, so keeps 128.
    assert LayerGemm.for_layer(4096, 4096, cpu, sms=132).tiles_for_rows(1) == FEW_ROWS_TILES[128][64]
    assert LayerGemm.for_layer(4096, 14336, cpu, sms=132).tiles_for_rows(1) == LONG_K_TILES
    # A layer of several K splits runs its wide tiles a stage deeper, where the stage fits.
    assert LayerGemm.for_layer(1024, 2048, cpu, sms=132).wide.num_stages == WIDE_SPLIT_STAGES
    assert LayerGemm.for_layer(4096, 1024, cpu, sms=132).wide.num_stages == 3  # one split
    assert LayerGemm.for_layer(4096, 4096, cpu, sms=132).wide.num_stages == 3  # BLOCK_K 128: no room
    # float32 long-K tiles keep the narrow at every M: the wide pipeline would not fit.
    assert LayerGemm.for_layer(N, 4096, cpu, 4).tiles_for_rows(10**6) == LONG_K_TILES
    x, weight, bias = _inputs(torch.float16, rows=3)
    narrow = batch_invariant_matmul(x, weight, bias, gemm.num_splits, gemm.tiles)
    assert torch.equal(gemm(x, weight, bias), narrow)


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


def test_use_batch_invariant_gemms_routes_experts_and_refuses_what_has_no_invariant_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dataclasses

    from torch import nn

    from pagedllm.layers import custom_op
    from pagedllm.layers.batch_invariant_linear import use_batch_invariant_gemms
    from pagedllm.layers.fused_moe import FusedMoE
    from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding

    # The experts' invariant form is their Triton kernel (here under the interpreter on the CPU).
    platform = custom_op.platform_for(torch.device(DEVICE))
    monkeypatch.setattr(custom_op, "platform_for", lambda device: dataclasses.replace(platform, triton=True))
    model = nn.Module()
    model.experts = FusedMoE(4, 2, 64, 32, True).to(DEVICE)
    model.lm_head = VocabParallelEmbedding(150, 64).to(DEVICE)
    use_batch_invariant_gemms(model, torch.device(DEVICE))
    assert model.experts.forward_method == model.experts.forward_triton_invariant

    class OwnExperts(FusedMoE):
        has_batch_invariant_form = False

    model.experts = OwnExperts(4, 2, 64, 32, True).to(DEVICE)
    with pytest.raises(ValueError, match=r"batch_invariant=True: experts \(OwnExperts\) has no"):
        use_batch_invariant_gemms(model, torch.device(DEVICE))
