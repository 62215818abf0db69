"""Hermes' (and Qwen's) format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one block per call, after optional text."""

from __future__ import annotations

import re

from pagedllm.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ToolParser, parse_call

START, END = "<tool_call>", "</tool_call>"
# A block, or an unclosed last one (the output ended before its closing tag).
_BLOCK = re.compile(re.escape(START) + r"\s*(.*?)\s*(?:" + re.escape(END) + r"|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(START)
        if start < 0:
            return ExtractedToolCalls(content=text)
        calls = [
            parse_call(match.group(1), ("arguments", "parameters")) for match in _BLOCK.finditer(text, start)
        ]
        if not calls or any(call is None for call in calls):
            return ExtractedToolCalls(content=text)  # not a well-formed call: the text is the answer
        content = text[:start].strip()
        return ExtractedToolCalls(content=content or None, calls=calls)

    def may_start_call(self, text: str) -> bool:
        # The marker appeared, or the text ends with a prefix of it.
        return START in text or any(text.endswith(START[:i]) for i in range(1, len(START)))
