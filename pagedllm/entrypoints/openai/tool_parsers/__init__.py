"""Tool-call parsers: a model's text -> the function calls in it (vLLM's ``--tool-call-parser``)."""

from pagedllm.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.openai import OpenAIToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from pagedllm.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from pagedllm.entrypoints.openai.tool_parsers.streaming import ToolCallDelta, ToolCallStreamer

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    # Qwen2.5 and Qwen3 write Hermes' format.
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    # gpt-oss's harmony commentary calls (with the openai_gptoss reasoning parser).
    "openai": OpenAIToolParser,
}

__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "OpenAIToolParser",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "ToolCallDelta",
    "ToolCallStreamer",
    "ToolParser",
]
