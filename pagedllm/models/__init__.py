"""Model implementations, looked up by the Hugging Face ``architectures`` field of a config."""

from __future__ import annotations

from torch import nn

from pagedllm.models.bloom import BloomForCausalLM
from pagedllm.models.deepseek_v2 import DeepseekV2ForCausalLM
from pagedllm.models.deepseek_v3 import DeepseekV3ForCausalLM
from pagedllm.models.gemma import GemmaForCausalLM
from pagedllm.models.glm4_moe import Glm4MoeForCausalLM
from pagedllm.models.gpt2 import GPT2LMHeadModel
from pagedllm.models.gpt_oss import GptOssForCausalLM
from pagedllm.models.granitemoehybrid import BambaForCausalLM, GraniteMoeHybridForCausalLM
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.mixtral import MixtralForCausalLM
from pagedllm.models.nemotron_h import NemotronHForCausalLM
from pagedllm.models.olmo2 import Exaone4ForCausalLM, Olmo2ForCausalLM
from pagedllm.models.qwen3_moe import Qwen3MoeForCausalLM
from pagedllm.models.qwen3_next import Qwen3NextForCausalLM

# Hugging Face architecture name -> our implementation.
_MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3NextForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "BloomForCausalLM": BloomForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,  # DeepSeek-V3, R1, Kimi-K2
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,  # IBM Granite 4.0-H
    "BambaForCausalLM": BambaForCausalLM,
}

# Bare decoders (transformers' *Model, no LM head): checkpoints of embedding models such as
# Qwen3-Embedding's or e5-mistral's. They run as pooling models (runner "auto" picks pooling), on
# the same implementation: their tensors lack the "model." prefix (model_loader adds it).
POOLING_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": LlamaForCausalLM,
    "Qwen2Model": LlamaForCausalLM,
    "Qwen3Model": LlamaForCausalLM,
}
_MODEL_REGISTRY.update(POOLING_ARCHITECTURES)

# config.model_type -> the architecture it means, for configs without ``architectures`` (as
# transformers' AutoModelForCausalLM maps them).
_MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "bloom": "BloomForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "bamba": "BambaForCausalLM",
}


def get_model_class(architectures: list[str], model_type: str | None = None) -> type[nn.Module]:
    """The implementation of the first supported name in ``architectures``; when the config has
    none, the one its ``model_type`` stands for."""
    if not architectures and model_type in _MODEL_TYPE_ARCHITECTURES:
        architectures = [_MODEL_TYPE_ARCHITECTURES[model_type]]
    for architecture in architectures:
        if architecture in _MODEL_REGISTRY:
            return _MODEL_REGISTRY[architecture]
    raise ValueError(
        f"model architectures {architectures} (model_type {model_type!r}) are not supported; "
        f"supported: {get_supported_architectures()}"
    )


def get_supported_architectures() -> list[str]:
    return sorted(_MODEL_REGISTRY)


__all__ = [
    "BambaForCausalLM",
    "BloomForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Exaone4ForCausalLM",
    "GPT2LMHeadModel",
    "GemmaForCausalLM",
    "Glm4MoeForCausalLM",
    "GptOssForCausalLM",
    "GraniteMoeHybridForCausalLM",
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "NemotronHForCausalLM",
    "Olmo2ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "get_model_class",
    "get_supported_architectures",
]
