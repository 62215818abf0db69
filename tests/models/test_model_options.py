"""What the model families read from their configs: per-layer windows, the registry's fallback to
``model_type``, ALiBi slopes, and the ValueErrors for options we do not implement."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    BloomConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.model_loader import get_model
from pagedllm.models import (
    BloomForCausalLM,
    GemmaForCausalLM,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    get_model_class,
)
from pagedllm.models.bloom import alibi_slopes
from pagedllm.models.utils import layer_sliding_windows

SMALL = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=1,
    num_key_value_heads=1,
    max_position_embeddings=256,
)


def _windows_of(model: torch.nn.Module) -> list[int | None]:
    return [m.impl.sliding_window for m in model.modules() if hasattr(m, "impl")]


@pytest.mark.parametrize(
    "config, expected",
    [
        # Mistral: every layer.
        (MistralConfig(num_hidden_layers=3, sliding_window=32, **SMALL), [32, 32, 32]),
        (MistralConfig(num_hidden_layers=2, sliding_window=None, **SMALL), [None, None]),
        # Qwen2/Qwen3: layers >= max_window_layers, only with use_sliding_window.
        (
            Qwen2Config(
                num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2, **SMALL
            ),
            [None, None, 16, 16],
        ),
        (
            Qwen3Config(
                num_hidden_layers=3, use_sliding_window=True, sliding_window=16, max_window_layers=0, **SMALL
            ),
            [16, 16, 16],
        ),
        (
            Qwen2Config(num_hidden_layers=2, use_sliding_window=False, sliding_window=16, **SMALL),
            [None, None],
        ),
        # Gemma 2 alternates, local first; Gemma 3: five local, then a global one.
        (Gemma2Config(num_hidden_layers=4, sliding_window=8, **SMALL), [8, None, 8, None]),
        (
            Gemma3TextConfig(num_hidden_layers=7, sliding_window=8, **SMALL),
            [8, 8, 8, 8, 8, None, 8],
        ),
    ],
)
def test_layer_windows_follow_transformers(config, expected: list) -> None:
    assert layer_sliding_windows(config) == expected
    # And the attention layers are built with them.
    model = get_model_class(config.architectures or [], config.model_type)(config, TorchAttentionBackend)
    assert _windows_of(model) == expected


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"sliding_window": -4}, "sliding_window"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": 512}, "sliding_window 512 is larger than max_position_embeddings"),
    ],
)
def test_bad_windows_are_refused(overrides: dict, match: str) -> None:
    config = MistralConfig(num_hidden_layers=1, **{**SMALL, **overrides})
    with pytest.raises(ValueError, match=match):
        LlamaForCausalLM(config, TorchAttentionBackend)


def test_unknown_layer_type_is_refused() -> None:
    config = Gemma2Config(num_hidden_layers=2, sliding_window=8, **SMALL)
    config.layer_types = ["sliding_attention", "chunked_attention"]
    with pytest.raises(ValueError, match=r"layer_types.*chunked_attention"):
        GemmaForCausalLM(config, TorchAttentionBackend)


@pytest.mark.parametrize(
    "config, match",
    [
        (
            GPT2Config(n_layer=1, n_embd=64, n_head=1, scale_attn_by_inverse_layer_idx=True),
            "scale_attn_by_inverse",
        ),
        (GPT2Config(n_layer=1, n_embd=64, n_head=1, activation_function="swish"), "activation_function"),
        (
            Gemma3TextConfig(
                num_hidden_layers=1, sliding_window=8, use_bidirectional_attention=True, **SMALL
            ),
            "use_bidirectional_attention",
        ),
        (
            Gemma2Config(num_hidden_layers=1, sliding_window=8, hidden_activation="relu", **SMALL),
            "hidden_act",
        ),
        (
            MistralConfig(num_hidden_layers=1, rope_parameters={"rope_type": "su", "factor": 2.0}, **SMALL),
            "rope_type 'su'",
        ),
    ],
)
def test_unsupported_options_are_named(config, match: str) -> None:
    model_class = get_model_class(config.architectures or [], config.model_type)
    with pytest.raises(ValueError, match=match):
        model_class(config, TorchAttentionBackend)


@pytest.mark.parametrize(
    "model_type, model_class",
    [
        ("gpt2", GPT2LMHeadModel),
        ("bloom", BloomForCausalLM),
        ("gemma2", GemmaForCausalLM),
        ("gemma3_text", GemmaForCausalLM),
        ("mistral", LlamaForCausalLM),
    ],
)
def test_registry_falls_back_to_model_type(model_type: str, model_class: type) -> None:
    assert get_model_class([], model_type) is model_class
    # architectures, when present, decide.
    assert get_model_class(["BloomForCausalLM"], model_type) is BloomForCausalLM


def test_registry_refuses_an_unknown_model_type() -> None:
    with pytest.raises(ValueError, match="model_type 'falcon'"):
        get_model_class([], "falcon")


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 6, 8, 12, 16, 20])
def test_alibi_slopes_match_bloom(num_heads: int) -> None:
    torch.testing.assert_close(alibi_slopes(num_heads), _get_alibi_slopes(num_heads, torch.device("cpu")))


@pytest.mark.parametrize(
    "config",
    [
        GPT2Config(n_layer=2, n_embd=64, n_head=1, vocab_size=64),
        BloomConfig(n_layer=2, hidden_size=64, n_head=1, vocab_size=64),
        Gemma2Config(num_hidden_layers=2, sliding_window=8, **SMALL),
        Gemma3TextConfig(num_hidden_layers=2, sliding_window=8, **SMALL),
    ],
    ids=["gpt2", "bloom", "gemma2", "gemma3"],
)
def test_dummy_weights_load_for_every_family(config, paged_runner: type) -> None:
    config.architectures = None  # found by model_type
    model_config = ModelConfig(
        model="dummy", tokenizer="dummy", hf_config=config, dtype=torch.float32, max_model_len=64
    )
    model = get_model(model_config, "dummy", torch.device("cpu"), TorchAttentionBackend)
    logits = paged_runner(model, model_config).step({0: list(range(20))})[0]
    assert logits.shape == (20, 64) and logits.isfinite().all()
