"""Hermes' (and Qwen's) format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one block per call, after optional text."""

from __future__ import annotations

import re

from pagedllm.entrypoints.openai.text_markers import held_prefix_len
from pagedllm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    PartialToolCalls,
    ToolParser,
    parse_call,
    partial_json_call,
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
        if not calls or any(call is None for call in calls):
            return ExtractedToolCalls(content=text)  # not a well-formed call: the text is the answer
        content = text[:start].strip()
        return ExtractedToolCalls(content=content or None, calls=calls)

    def partial(self, text: str) -> PartialToolCalls:
        start = text.find(START)
        if start < 0:
            return PartialToolCalls(len(text) - held_prefix_len(text, START))
        result = PartialToolCalls(start)
        while start >= 0:
            end = text.find(END, start)
            call, _ = partial_json_call(
                text[: end if end >= 0 else len(text)], start + len(START), ARGUMENTS_KEYS
            )
            result.calls.append(call)
            if end < 0:
                break
            start = text.find(START, end)
        return result
