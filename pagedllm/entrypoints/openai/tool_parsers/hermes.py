"""Hermes' (and Qwen's) format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one block per call, after optional text."""

from __future__ import annotations

import re

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    PartialCall,
    PartialToolCalls,
    ToolParser,
    calls_after,
    parse_call,
    partial_json_call,
    tagged_calls,
)

START, END = "<tool_call>", "</tool_call>"
ARGUMENTS_KEYS = ("arguments", "parameters")
# A block, or an unclosed last one (the output ended before its closing tag).
_BLOCK = re.compile(re.escape(START) + r"\s*(.*?)\s*(?:" + re.escape(END) + r"|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(START)
        if start < 0:
            return ExtractedToolCalls(content=text)
        calls = [parse_call(match.group(1), ARGUMENTS_KEYS) for match in _BLOCK.finditer(text, start)]
        return calls_after(text, start, calls)

    def partial(self, text: str) -> PartialToolCalls:
        return tagged_calls(text, START, END, _json_call)


def _json_call(text: str, body_start: int, body_end: int) -> PartialCall:
    return partial_json_call(text[:body_end], body_start, ARGUMENTS_KEYS)[0]
