"""The Llama family against Hugging Face transformers, in float32 on the CPU, through a paged cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, PreTrainedModel, Qwen2Config, Qwen3Config

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.model_loader import get_model
from pagedllm.models import LlamaForCausalLM, get_model_class

ATOL = 1e-4

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Short, so that the scaling changes the frequencies the short test prompts use.
    "original_max_position_embeddings": 16,
}

# (config class, overrides): head counts, GQA ratios, head sizes, biases, norms, tying, rope scaling.
CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "llama-gqa-tied": (
        LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "llama-mha-bias-untied": (
        LlamaConfig,
        dict(num_attention_heads=2, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    ),
    "llama-mqa-head128": (LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=1, head_dim=128)),
    "llama-llama3-rope": (
        LlamaConfig,
        dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64, rope_parameters=LLAMA3_ROPE),
    ),
    "llama-linear-rope": (
        LlamaConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "linear", "factor": 4.0},
        ),
    ),
    "mistral-head64": (
        MistralConfig,
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64, sliding_window=None),
    ),
    "qwen2-tied": (Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-head64": (Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64)),
    "qwen3-head128-tied": (
        Qwen3Config,
        dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128, tie_word_embeddings=True),
    ),
}


@pytest.fixture
def load_case(
    make_tiny_model: Callable,
) -> Callable[[str], tuple[PreTrainedModel, ModelConfig, LlamaForCausalLM]]:
    """load(case) -> (HF model, ModelConfig, our model loaded from the HF model's directory)."""

    def load(case: str) -> tuple[PreTrainedModel, ModelConfig, LlamaForCausalLM]:
        config_class, overrides = CASES[case]
        hf_model, model_config = make_tiny_model(config_class, **overrides)
        model = get_model(model_config, "auto", torch.device("cpu"), TorchAttentionBackend)
        return hf_model, model_config, model

    return load


def _prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab_size, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_then_decode_matches_hf(
    case: str, load_case: Callable, prefill_then_decode_match_hf: Callable
) -> None:
    prefill_then_decode_match_hf(*load_case(case), atol=ATOL)


def test_mixed_decode_and_prefill_batch(
    load_case: Callable, paged_runner: type, reference_logits: Callable
) -> None:
    hf_model, model_config, model = load_case("llama-gqa-tied")
    runner = paged_runner(model, model_config)
    first, second = _prompts(model_config.vocab_size, [9, 6])
    runner.step({0: first})
    # Sequence 0 decodes while sequence 1's prompt is prefilled, in the same step.
    logits = runner.step({0: [5], 1: second})
    torch.testing.assert_close(logits[0], reference_logits(hf_model, [*first, 5])[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], reference_logits(hf_model, second), atol=ATOL, rtol=0)


# Lengths around the runner's 4-token blocks: inside one, exactly full, one past, many blocks.
@pytest.mark.parametrize("length", [1, 3, 4, 5, 33])
def test_single_prompt_lengths(
    length: int, load_case: Callable, paged_runner: type, reference_logits: Callable
) -> None:
    hf_model, model_config, model = load_case("qwen3-head64")
    (prompt,) = _prompts(model_config.vocab_size, [length])
    logits = paged_runner(model, model_config).step({0: prompt})
    torch.testing.assert_close(logits[0], reference_logits(hf_model, prompt), atol=ATOL, rtol=0)


def test_registry_serves_every_family_with_one_implementation() -> None:
    for architecture in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert get_model_class([architecture]) is LlamaForCausalLM


def test_unknown_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*supported.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        get_model_class(["FalconForCausalLM"])


def test_tied_head_shares_the_embedding(load_case: Callable) -> None:
    _, _, model = load_case("qwen2-tied")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _, _, untied = load_case("qwen3-head64")
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
