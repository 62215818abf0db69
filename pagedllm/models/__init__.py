"""Model implementations, looked up by the Hugging Face ``architectures`` field of a config."""

from __future__ import annotations

from torch import nn

from pagedllm.models.llama import LlamaForCausalLM

# Hugging Face architecture name -> our implementation.
_MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    """The implementation of the first supported name in ``architectures``."""
    for architecture in architectures:
        if architecture in _MODEL_REGISTRY:
            return _MODEL_REGISTRY[architecture]
    raise ValueError(
        f"model architectures {architectures} are not supported; supported: {get_supported_architectures()}"
    )


def get_supported_architectures() -> list[str]:
    return sorted(_MODEL_REGISTRY)


__all__ = ["LlamaForCausalLM", "get_model_class", "get_supported_architectures"]
