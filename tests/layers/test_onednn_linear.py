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
from pagedllm.model_loader import get_model

pytestmark = pytest.mark.skipif(not onednn_available(torch.float32), reason="torch built without oneDNN")
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 32, 300])
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
