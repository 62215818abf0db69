"""Model implementations, looked up by the Hugging Face ``architectures`` field of a config."""

from __future__ import annotations

from torch import nn

from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.mixtral import MixtralForCausalLM
from pagedllm.models.qwen3_moe import Qwen3MoeForCausalLM

# Hugging Face architecture name -> our implementation.
_MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
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


__all__ = [
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "get_model_class",
    "get_supported_architectures",
]
