"""Reasoning parsers: a model's output -> its reasoning and its answer (vLLM's
``--reasoning-parser``)."""

from pagedllm.entrypoints.openai.reasoning_parsers.base import ReasoningDelta, ReasoningParser
from pagedllm.entrypoints.openai.reasoning_parsers.harmony import HarmonyReasoningParser
from pagedllm.entrypoints.openai.reasoning_parsers.think_tags import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    # gpt-oss's harmony channels; vLLM's name first, the others as aliases.
    "openai_gptoss": HarmonyReasoningParser,
    "gpt_oss": HarmonyReasoningParser,
    "harmony": HarmonyReasoningParser,
}

__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "HarmonyReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
]
