"""Dense linear layers and the LM head with oneDNN-prepacked weights, against F.linear."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from pagedllm.attention.backends.cpu_backend import CpuAttentionBackend
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.onednn_linear import (
    OneDNNLinearMethod,
    OneDNNTiedLMHeadMethod,
    onednn_available,
    prepack_dense_weights,
)
from pagedllm.layers.row_buckets import padded_rows
from pagedllm.model_loader import get_model

pytestmark = pytest.mark.skipif(not onednn_available(torch.float32), reason="torch built without oneDNN")
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 17, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_matches_f_linear(dtype: torch.dtype, num_tokens: int, bias: bool) -> None:
    torch.manual_seed(0)
    layer = ReplicatedLinear(96, 80, bias=bias).to(dtype)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    weight, b = layer.weight.data.clone(), None if layer.bias is None else layer.bias.data.clone()
    layer.quant_method = OneDNNLinearMethod()
    layer.quant_method.process_weights_after_loading(layer)
    assert "weight" not in dict(layer.named_parameters())  # the blocked copy replaced it
    x = torch.randn(num_tokens, 96).to(dtype)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(layer(x).float(), F.linear(x, weight, b).float(), atol=atol * 10, rtol=rtol)


@pytest.mark.parametrize("tied", [False, True])
def test_prepacked_model_computes_the_same_logits(
    make_tiny_model: Callable, paged_runner: type, tied: bool
) -> None:
    _, model_config = make_tiny_model(
        LlamaConfig, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied
    )
    prompt = list(range(5, 30))
    plain = get_model(model_config, "auto", torch.device("cpu"), CpuAttentionBackend)
    expected = paged_runner(plain, model_config).step({0: prompt})[0]
    packed = get_model(model_config, "auto", torch.device("cpu"), CpuAttentionBackend)
    prepack_dense_weights(packed)
    assert isinstance(packed.lm_head.quant_method, OneDNNLinearMethod)
    head_params = dict(packed.lm_head.named_parameters())
    if tied:  # the row-major table stays for the embedding's lookups
        assert isinstance(packed.lm_head.quant_method, OneDNNTiedLMHeadMethod)
        assert head_params["weight"] is packed.model.embed_tokens.weight
    else:  # a head of its own keeps only the blocked copy
        assert "weight" not in head_params
    logits = paged_runner(packed, model_config).step({0: prompt})[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_padded_rows_bounds_the_padding_and_the_shapes() -> None:
    # What the bucketing promises, checked over every row count of a step up to 8,192 tokens.
    for rows in range(1, 8193):
        padded = padded_rows(rows)
        assert rows <= padded <= rows * 1.125, rows
        assert padded_rows(padded) == padded, rows  # a bucket is its own bucket
        if rows <= 16:
            assert padded == rows  # small decode batches run unpadded
    # 16 exact sizes, then 8 per doubling: 16..2,048 is 7 doublings, 2,048..8,192 two more.
    assert len({padded_rows(r) for r in range(1, 2049)}) == 16 + 8 * 7
    assert len({padded_rows(r) for r in range(1, 8193)}) == 16 + 8 * 9


def test_linear_sees_only_bucketed_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row count from 1 to 300 gives F.linear's rows, while oneDNN (whose primitive caches
    hold one primitive per input shape) sees only the buckets' shapes."""
    torch.manual_seed(0)
    layer = ReplicatedLinear(24, 40, bias=True)
    # Layers allocate their parameters empty (a checkpoint fills them): whatever memory they got
    # could hold NaN, which no comparison passes.
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    weight, bias = layer.weight.data.clone(), layer.bias.data.clone()
    layer.quant_method = OneDNNLinearMethod()
    layer.quant_method.process_weights_after_loading(layer)
    seen: set[tuple[int, ...]] = set()
    linear_pointwise = torch.ops.mkldnn._linear_pointwise

    def recording(x: torch.Tensor, *args: object) -> torch.Tensor:
        seen.add(tuple(x.shape))
        return linear_pointwise(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", recording)
    for rows in range(1, 301):
        x = torch.randn(rows, 24)
        out = layer(x)
        assert out.shape == (rows, 40)
        torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
    # 1-16 as they are; then steps of 2 up to 32, of 4 up to 64, ... of 32 up to 512.
    buckets = [*range(1, 17), *range(18, 33, 2), *range(36, 65, 4), *range(72, 129, 8), *range(144, 257, 16)]
    assert seen == {(r, 24) for r in [*buckets, 288, 320]}
