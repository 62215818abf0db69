"""GGUF Q4 linear weights and quantized embedding tables kept quantized, against the gguf
package's own dequantization."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear
from pagedllm.layers.onednn_linear import INT4_HEAD_MAX_ROWS, OneDNNTiedLMHeadMethod, onednn_available
from pagedllm.layers.quantization import keeps_gguf_quantized
from pagedllm.layers.quantization.gguf import (
    BLOCK_BYTES,
    GGUFEmbeddingMethod,
    GGUFQ4LinearMethod,
    dequantize_rows,
    unsupported_reason,
)
from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding

Q4_TYPES = ["Q4_0", "Q4_1"]
EMBEDDING_TYPES = ["Q8_0", "Q4_0", "Q4_1"]


def quantize(weight: torch.Tensor, tensor_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw blocks uint8 [N, row_bytes], what gguf dequantizes them to, float32 [N, K])."""
    kind = gguf.GGMLQuantizationType[tensor_type]
    raw = gguf.quants.quantize(weight.numpy(), kind)
    return torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, kind))


@pytest.mark.parametrize("tensor_type", Q4_TYPES)
def test_q4_block_decoding_matches_gguf_dequantize(tensor_type: str) -> None:
    raw, expected = quantize(torch.randn(48, 96) * 3 + 0.5, tensor_type)
    assert torch.equal(dequantize_rows(raw, tensor_type), expected)


def quantized_layer(layer: torch.nn.Module, tensor_type: str) -> GGUFQ4LinearMethod:
    method = GGUFQ4LinearMethod(tensor_type)
    method.create_weights(layer)
    layer.quant_method = method
    return method


@pytest.mark.parametrize("tensor_type", Q4_TYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 7, 32])
def test_q4_linear_matches_dequantized_oracle(tensor_type: str, dtype: torch.dtype, num_tokens: int) -> None:
    torch.manual_seed(0)
    layer = ReplicatedLinear(128, 64, bias=True)
    raw, dense = quantize(torch.randn(64, 128), tensor_type)
    method = quantized_layer(layer, tensor_type)
    layer.weight.weight_loader(layer.weight, raw)
    layer.bias.data.copy_(torch.randn(64))
    method.process_weights_after_loading(layer)
    assert not hasattr(layer, "weight") or layer.weight is None
    x = torch.randn(num_tokens, 128).to(dtype)
    out = layer(x)
    expected = F.linear(x.float(), dense, layer.bias.float())
    assert out.dtype == dtype
    # The kernel computes in bf16 (activations, scales, zeros): ~1% of the output's scale.
    torch.testing.assert_close(out.float(), expected, atol=0.02 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("shape", [(64, 32), (192, 96), (960, 576), (128, 1536)])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4])
def test_few_rows_kernel_computes_what_torch_s_int4_kernel_does(
    shape: tuple[int, int], num_rows: int
) -> None:
    """pagedllm's kernel for one stream's rows reads torch's int4 packing: against the exact
    product (float64) of the weights the packing holds, its error is torch's kernel's, the bf16
    rounding of the output; the two agree bit for bit on almost every output."""
    n, k = shape
    gen = torch.Generator().manual_seed(n + k + num_rows)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    scales_and_zeros = (torch.randn(k // 32, n, 2, generator=gen) * 0.05).bfloat16()
    x = torch.randn(num_rows, k, generator=gen).bfloat16()
    per_group = [scales_and_zeros[..., i].double().t().repeat_interleave(32, dim=1) for i in (0, 1)]
    exact = x.double() @ ((q.double() - 8) * per_group[0] + per_group[1]).t()
    ours = cpu_ops.int4_matmul_few_rows(x, packed, scales_and_zeros)
    theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)
    assert ours.dtype == torch.bfloat16 and ours.shape == (num_rows, n)
    # bf16 keeps 8 significant bits: the output's rounding moves it by at most 2^-8 of itself.
    torch.testing.assert_close(ours.double(), exact, atol=1e-3, rtol=2**-8)
    assert (ours == theirs).double().mean() > 0.99
    with pytest.raises(RuntimeError, match="multiple of 64"):
        cpu_ops.int4_matmul_few_rows(x, packed[:-16], scales_and_zeros)


@pytest.mark.parametrize("tensor_type", Q4_TYPES)
def test_packed_shards_load_as_raw_rows(tensor_type: str) -> None:
    """q/k/v and gate/up loaded shard by shard as raw blocks equal the stacked dense weights."""
    torch.manual_seed(1)
    qkv = QKVParallelLinear(hidden_size=64, head_size=16, total_num_heads=4, total_num_kv_heads=2, bias=False)
    gate_up = MergedColumnParallelLinear(64, [96, 96], bias=False)
    for layer, shards in ((qkv, {"q": 64, "k": 32, "v": 32}), (gate_up, {0: 96, 1: 96})):
        method = quantized_layer(layer, tensor_type)
        dense = []
        for shard_id, rows in shards.items():
            raw, weight = quantize(torch.randn(rows, 64), tensor_type)
            layer.weight.weight_loader(layer.weight, raw, shard_id)
            dense.append(weight)
        method.process_weights_after_loading(layer)
        x = torch.randn(5, 64).bfloat16()
        expected = x.float() @ torch.cat(dense).t()
        torch.testing.assert_close(
            layer(x).float(), expected, atol=0.02 * expected.abs().max().item(), rtol=0
        )


def test_unsupported_reason_names_type_and_shape() -> None:
    assert unsupported_reason("Q4_1", 64, 128) is None
    assert "Q6_K" in unsupported_reason("Q6_K", 64, 128)
    assert "multiple" in unsupported_reason("Q4_0", 64, 100)
    assert "multiple" in unsupported_reason("Q4_0", 40, 128)


def test_when_gguf_weights_stay_quantized() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert keeps_gguf_quantized("auto", True, cpu, torch.bfloat16)
    assert not keeps_gguf_quantized("auto", True, cpu, torch.float32)  # HF comparisons stay dense
    assert keeps_gguf_quantized("gguf", True, cpu, torch.float32)
    assert not keeps_gguf_quantized("none", True, cpu, torch.bfloat16)
    assert not keeps_gguf_quantized("auto", False, cpu, torch.bfloat16)
    assert not keeps_gguf_quantized("auto", True, cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="quantization='gguf' runs on the CPU only"):
        keeps_gguf_quantized("gguf", True, cuda, torch.bfloat16)


def test_raw_rows_stay_whole_blocks() -> None:
    """Q4_1's 20-byte blocks: a [64, 128] weight is 64 rows of 4 blocks."""
    raw, _ = quantize(torch.randn(64, 128), "Q4_1")
    assert raw.shape == (64, 80) and raw.dtype == torch.uint8
    assert np.prod(raw.shape) == 64 * 128 // 32 * 20


@pytest.mark.parametrize("tensor_type", EMBEDDING_TYPES)
def test_row_dequantization_is_gguf_s_bit_for_bit(tensor_type: str) -> None:
    """The values the dequantized path loads (gguf's numpy dequantization), exactly: a table kept
    quantized must not change a single embedding."""
    torch.manual_seed(2)
    raw, expected = quantize(torch.randn(300, 96) * torch.logspace(-3, 2, 300)[:, None], tensor_type)
    ours = dequantize_rows(raw, tensor_type)
    assert ours.dtype == torch.float32
    assert torch.equal(ours.view(torch.int32), expected.view(torch.int32))  # -0.0 included


def quantized_embedding(
    tensor_type: str, dtype: torch.dtype, num_embeddings: int = 200, embedding_dim: int = 96
) -> tuple[VocabParallelEmbedding, torch.Tensor]:
    """(An embedding keeping a random table as ``tensor_type`` blocks, the dense table in ``dtype``
    that the dequantized path would load)."""
    torch.manual_seed(3)
    layer = VocabParallelEmbedding(num_embeddings, embedding_dim).to(dtype)
    raw, table = quantize(torch.randn(num_embeddings, embedding_dim), tensor_type)
    layer.quant_method = GGUFEmbeddingMethod(tensor_type)
    layer.quant_method.create_weights(layer)
    layer.weight.weight_loader(layer.weight, raw)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, table.to(dtype)


@pytest.mark.parametrize("tensor_type", EMBEDDING_TYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantized_embedding_lookup_equals_the_dequantized_table(
    tensor_type: str, dtype: torch.dtype
) -> None:
    layer, table = quantized_embedding(tensor_type, dtype)
    assert layer.weight.dtype == torch.uint8 and layer.weight.nbytes < table.nbytes
    input_ids = torch.randint(0, 200, (333,))
    out = layer(input_ids)
    assert out.dtype == dtype and torch.equal(out, F.embedding(input_ids, table))
    assert torch.equal(layer(input_ids.view(9, 37)), F.embedding(input_ids.view(9, 37), table))
    assert torch.equal(layer.quant_method.dequantize(layer), table)
    x = torch.randn(5, 96).to(dtype)
    assert torch.equal(layer.quant_method.apply(layer, x, None), F.linear(x, table))  # a tied head


@pytest.mark.skipif(not onednn_available(torch.bfloat16), reason="torch built without oneDNN")
@pytest.mark.parametrize("tensor_type", EMBEDDING_TYPES)
def test_tied_head_on_a_quantized_table_equals_the_dense_tied_head(tensor_type: str) -> None:
    """The CPU worker's tied head over a table kept quantized: the blocked copy for the matmul and
    the quantized rows for lookups, no dense row-major table beside them (a Q4 table adds its int4
    packing, for products of few rows); the same embeddings, and logits of more rows than the int4
    kernel takes, bit for bit, as the tied head over the dense table."""
    layer, table = quantized_embedding(tensor_type, torch.bfloat16, num_embeddings=256)
    layer.quant_method = OneDNNTiedLMHeadMethod(layer.quant_method)
    layer.quant_method.process_weights_after_loading(layer)
    dense = VocabParallelEmbedding(256, 96).to(torch.bfloat16)
    dense.weight.data.copy_(table)
    dense.quant_method = OneDNNTiedLMHeadMethod()
    dense.quant_method.process_weights_after_loading(dense)
    held = {name: t.dtype for name, t in [*layer.named_parameters(), *layer.named_buffers()]}
    int4 = {"qweight": torch.uint8, "scales_and_zeros": torch.bfloat16} if tensor_type in BLOCK_BYTES else {}
    assert held == {"weight": torch.uint8, "packed_weight": torch.bfloat16, **int4}
    input_ids = torch.randint(0, 256, (64,))
    assert torch.equal(layer(input_ids), dense(input_ids))
    x = torch.randn(INT4_HEAD_MAX_ROWS + 3, 96).bfloat16()
    assert torch.equal(layer.quant_method.apply(layer, x, None), dense.quant_method.apply(dense, x, None))
