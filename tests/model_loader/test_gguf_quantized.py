"""A GGUF model with quantized linear weights kept quantized, against the same file dequantized.

Tiny llama GGUFs are written here with gguf's writer (linear weights in one GGML type, the rest
float32); on the embedded SmolLM2 the two paths are compared on logits and greedy tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import unittest.mock
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from pagedllm.attention.backends.cpu_backend import CpuAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.layers import onednn_linear
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.onednn_linear import INT4_HEAD_MAX_ROWS, OneDNNTiedLMHeadMethod, prepack_dense_weights
from pagedllm.layers.quantization.gguf import GGUFEmbeddingMethod, GGUFQ4LinearMethod
from pagedllm.model_loader import get_model, gguf_loader
from pagedllm.model_loader.gguf_loader import load_gguf_config

CPU = torch.device("cpu")
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_tiny_gguf(
    make_tiny_model: Callable, path: Path, linear_type: str, embedding_type: str = "F32", tied: bool = False
) -> ModelConfig:
    """A 2-layer llama GGUF of random weights; linear weights quantized to ``linear_type``, the
    embedding table to ``embedding_type``; ``tied``: no output.weight (the head is the table)."""
    hf_model, _ = make_tiny_model(
        LlamaConfig, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied
    )
    config = hf_model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    for hf_name, tensor in hf_model.state_dict().items():
        module, _, suffix = hf_name.rpartition(".")
        if tied and module == "lm_head":
            continue
        array = tensor.float().numpy()
        kind = gguf.GGMLQuantizationType.F32
        if suffix == "weight" and module.rsplit(".", 1)[-1] in LINEAR_MODULES:
            kind = gguf.GGMLQuantizationType[linear_type]
        elif module == "model.embed_tokens":
            kind = gguf.GGMLQuantizationType[embedding_type]
        if kind != gguf.GGMLQuantizationType.F32:
            array = gguf.quants.quantize(array, kind)
        writer.add_tensor(f"{name_map.get_name(module)}.{suffix}", array, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return ModelConfig(
        model=str(path),
        tokenizer=str(path),
        hf_config=load_gguf_config(str(path)),
        dtype=torch.bfloat16,
        max_model_len=128,
        gguf_file=str(path),
        skip_tokenizer_init=True,
    )


def logits_of(
    model_config: ModelConfig, paged_runner: type, prompt: list[int], prepack: bool = False
) -> torch.Tensor:
    model = get_model(model_config, "gguf", CPU, CpuAttentionBackend)
    if prepack:  # as the CPU worker does
        prepack_dense_weights(model)
    runner = paged_runner(model, model_config)
    logits = runner.step({0: prompt})[0]
    return torch.cat([logits, runner.step({0: [int(logits[-1].argmax())]})[0]])


@pytest.mark.parametrize("linear_type", ["Q4_0", "Q4_1"])
def test_q4_gguf_model_matches_its_dequantized_oracle(
    make_tiny_model: Callable, tmp_path: Path, paged_runner: type, linear_type: str
) -> None:
    model_config = write_tiny_gguf(make_tiny_model, tmp_path / "tiny.gguf", linear_type)
    prompt = list(range(3, 40))
    quantized_config = dataclasses.replace(model_config, quantization="gguf")
    model = get_model(quantized_config, "gguf", CPU, CpuAttentionBackend)
    linear_layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linear_layers) == 8 and all(m.quant_method is not None for m in linear_layers)
    ours = logits_of(quantized_config, paged_runner, prompt)
    oracle = logits_of(
        dataclasses.replace(model_config, quantization="none", dtype=torch.float32), paged_runner, prompt
    )
    error = (ours - oracle).abs().max().item()
    # bf16 activations/scales through two layers: measured ~1% of the logit range.
    assert error < 0.05 * oracle.abs().max().item(), error
    assert (ours.argmax(-1) == oracle.argmax(-1)).float().mean() >= 0.9


def test_q8_0_linear_weights_fall_back_with_a_notice_or_refuse_when_asked(
    make_tiny_model: Callable, tmp_path: Path, paged_runner: type, caplog: pytest.LogCaptureFixture
) -> None:
    model_config = write_tiny_gguf(make_tiny_model, tmp_path / "tiny-q8.gguf", "Q8_0")
    with caplog.at_level(logging.WARNING):
        model = get_model(model_config, "gguf", CPU, CpuAttentionBackend)  # quantization="auto"
    assert "run dequantized" in caplog.text and "Q8_0" in caplog.text
    assert not any(isinstance(getattr(m, "quant_method", None), GGUFQ4LinearMethod) for m in model.modules())
    with pytest.raises(ValueError, match=r"quantization='gguf' cannot keep .*Q8_0"):
        get_model(dataclasses.replace(model_config, quantization="gguf"), "gguf", CPU, CpuAttentionBackend)


@pytest.mark.parametrize("embedding_type", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("tied", [False, True])
def test_quantized_embedding_table_gives_the_logits_of_its_dequantized_table(
    make_tiny_model: Callable,
    tmp_path: Path,
    paged_runner: type,
    monkeypatch: pytest.MonkeyPatch,
    embedding_type: str,
    tied: bool,
) -> None:
    """The table kept in its GGUF blocks (a third of its bf16 size for Q8_0) changes no logit, bit
    for bit, as a loaded model and as the CPU worker prepacks it (tied: the head's blocked copy),
    except one: a tied Q4 head multiplies a decode's single row by the int4 kernel (its own test
    below), the prompt's rows by the blocked copy."""
    model_config = dataclasses.replace(
        write_tiny_gguf(make_tiny_model, tmp_path / "tiny.gguf", "Q4_0", embedding_type, tied),
        quantization="gguf",
    )
    model = get_model(model_config, "gguf", CPU, CpuAttentionBackend)
    table = model.model.embed_tokens
    assert isinstance(table.quant_method, GGUFEmbeddingMethod) and table.weight.dtype == torch.uint8
    assert (model.lm_head is table) == tied
    prompt = list(range(3, 40))
    ours = [logits_of(model_config, paged_runner, prompt, prepack) for prepack in (False, True)]
    monkeypatch.setattr(gguf_loader, "keep_embedding_quantized", lambda *args: frozenset())
    dense_model = get_model(model_config, "gguf", CPU, CpuAttentionBackend)
    assert dense_model.model.embed_tokens.quant_method is None
    dense = [logits_of(model_config, paged_runner, prompt, prepack) for prepack in (False, True)]
    assert torch.equal(ours[0], dense[0])
    if tied and embedding_type != "Q8_0":
        assert torch.equal(ours[1][:-1], dense[1][:-1])
        torch.testing.assert_close(ours[1][-1], dense[1][-1], atol=0.02 * dense[1].abs().max().item(), rtol=0)
    else:
        assert torch.equal(ours[1], dense[1])


@pytest.mark.parametrize("embedding_type", ["Q4_0", "Q4_1"])
def test_tied_q4_head_multiplies_few_rows_by_the_int4_kernel(
    make_tiny_model: Callable, tmp_path: Path, embedding_type: str
) -> None:
    """A tied Q4 table in bf16 is also packed for the int4 kernel, which takes products of up to
    INT4_HEAD_MAX_ROWS rows (one stream's head reads a quarter of the bytes); more rows go to the
    blocked bf16 copy. Both give the table's logits: the int4 kernel rounds only the blocks'
    scales to bf16."""
    model_config = dataclasses.replace(
        write_tiny_gguf(make_tiny_model, tmp_path / "tiny.gguf", "Q4_0", embedding_type, tied=True),
        quantization="gguf",
    )
    model = get_model(model_config, "gguf", CPU, CpuAttentionBackend)
    table = model.model.embed_tokens.quant_method.dequantize(model.lm_head)  # the file's values, bf16
    prepack_dense_weights(model)
    method = model.lm_head.quant_method
    assert isinstance(method, OneDNNTiedLMHeadMethod) and method.int4_head
    hidden = torch.randn(INT4_HEAD_MAX_ROWS + 1, table.shape[1], generator=torch.Generator().manual_seed(0))
    hidden = hidden.bfloat16()
    expected = (hidden.float() @ table.float().t()).bfloat16()
    calls = []
    real = onednn_linear.q4_matmul
    with unittest.mock.patch.object(
        onednn_linear, "q4_matmul", lambda x, *args: calls.append(x.shape[0]) or real(x, *args)
    ):
        for rows in range(1, INT4_HEAD_MAX_ROWS + 2):
            logits = method.apply(model.lm_head, hidden[:rows], None)
            assert logits.dtype == torch.bfloat16 and logits.shape == (rows, table.shape[0])
            torch.testing.assert_close(
                logits.float(), expected[:rows].float(), atol=0.02 * expected.abs().max().item(), rtol=0
            )
    assert calls == list(range(1, INT4_HEAD_MAX_ROWS + 1))  # the int4 kernel, up to the limit only


def test_tied_quantized_table_stays_dense_without_a_blocked_head(
    make_tiny_model: Callable, tmp_path: Path
) -> None:
    """In float16 the CPU worker gives the head no blocked copy (oneDNN takes bf16 and fp32): a
    tied table kept quantized would be dequantized whole at every step, so it stays dense; an
    untied one is only looked up, and stays quantized."""
    for tied in (False, True):
        model_config = dataclasses.replace(
            write_tiny_gguf(make_tiny_model, tmp_path / f"tiny-{tied}.gguf", "Q4_0", "Q8_0", tied),
            quantization="gguf",
            dtype=torch.float16,
        )
        table = get_model(model_config, "gguf", CPU, CpuAttentionBackend).model.embed_tokens
        assert isinstance(table.quant_method, GGUFEmbeddingMethod) != tied


def test_quantization_gguf_needs_a_gguf_model(make_tiny_model: Callable) -> None:
    _, model_config = make_tiny_model(LlamaConfig)
    with pytest.raises(ValueError, match=r"quantization='gguf' needs a \.gguf model file"):
        dataclasses.replace(model_config, quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        dataclasses.replace(model_config, quantization="bitsandbytes")


@pytest.mark.slow
def test_smollm2_q4_path_agrees_with_dequantized(smollm2_gguf: str, paged_runner: type) -> None:
    """The embedded model's Q4_1 weights through the int4 kernel against the same file
    dequantized (bf16 both): logits within a bound, greedy tokens mostly equal."""
    base = ModelConfig(
        model=smollm2_gguf,
        tokenizer=smollm2_gguf,
        hf_config=load_gguf_config(smollm2_gguf),
        dtype=torch.bfloat16,
        max_model_len=256,
        gguf_file=smollm2_gguf,
    )
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378, 1345, 314]
    ours = logits_of(dataclasses.replace(base, quantization="gguf"), paged_runner, prompt)
    oracle = logits_of(dataclasses.replace(base, quantization="none"), paged_runner, prompt)
    scale = oracle.abs().max().item()
    assert (ours - oracle).abs().max().item() < 0.1 * scale
    assert (ours.argmax(-1) == oracle.argmax(-1)).float().mean() >= 0.75
    assert np.isfinite(ours.numpy()).all()
