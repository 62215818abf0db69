"""Tool-call parsers: a model's text -> the function calls in it (vLLM's ``--tool-call-parser``)."""

from pagedllm.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    # Qwen2.5 and Qwen3 write Hermes' format.
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}

__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "HermesToolParser", "Llama3JsonToolParser", "ToolParser"]
