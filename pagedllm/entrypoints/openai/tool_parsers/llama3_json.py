"""Llama 3.1's JSON format: the whole output is ``{"name": ..., "parameters": {...}}`` (optionally
after ``<|python_tag|>``), several calls separated by ``;``."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    PartialToolCalls,
    ToolParser,
    parse_call,
    partial_json_call,
)

PYTHON_TAG = "<|python_tag|>"
ARGUMENTS_KEYS = ("parameters", "arguments")


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
            call = parse_call(body[position:end], ARGUMENTS_KEYS)
            if call is None:
                return ExtractedToolCalls(content=text)
            calls.append(call)
            position = _skip_separators(body, end)
        return ExtractedToolCalls(content=None, calls=calls)

    def partial(self, text: str) -> PartialToolCalls:
        stripped = text.lstrip()
        if PYTHON_TAG.startswith(stripped):
            return PartialToolCalls(0)  # nothing yet, or the start of the tag
        body = stripped.removeprefix(PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return PartialToolCalls(0 if not body else len(text))
        result = PartialToolCalls(0)
        position = len(text) - len(body)
        while position < len(text):
            call, end = partial_json_call(text, position, ARGUMENTS_KEYS)
            result.calls.append(call)
            if end is None:
                break
            position = _skip_separators(text, end)
        return result


def _skip_separators(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \n\t;":
        position += 1
    return position
