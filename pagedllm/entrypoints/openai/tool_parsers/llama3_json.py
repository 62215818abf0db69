"""Llama 3.1's JSON format: the whole output is ``{"name": ..., "parameters": {...}}`` (optionally
after ``<|python_tag|>``), several calls separated by ``;``."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ToolParser, parse_call

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        if not body.startswith("{"):
            return ExtractedToolCalls(content=text)
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                _, end = decoder.raw_decode(body, position)
            except ValueError:
                return ExtractedToolCalls(content=text)
            call = parse_call(body[position:end], ("parameters", "arguments"))
            if call is None:
                return ExtractedToolCalls(content=text)
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \n\t;":
                position += 1
        return ExtractedToolCalls(content=None, calls=calls)

    def may_start_call(self, text: str) -> bool:
        body = text.lstrip()
        return not body or body.startswith("{") or PYTHON_TAG.startswith(body[: len(PYTHON_TAG)])
