"""The pythonic format (Llama 3.2 and 4, ToolACE): a Python list of calls with keyword
arguments, ``[get_weather(city="Paris", unit="C"), get_time(zone="UTC")]``, optionally between
``<|python_start|>`` and ``<|python_end|>``. Argument values are Python literals, returned as
JSON. A call's arguments stream whole once its closing parenthesis is written."""

from __future__ import annotations

import ast
import json
import re

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedCall,
    PartialCall,
    PartialToolCalls,
    ToolParser,
)

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"\s*,?\s*([A-Za-z_][A-Za-z0-9_.\-]*)\s*\(")


class PythonicToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        body = _body(text)
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError):
            return ExtractedToolCalls(content=text)
        if not isinstance(tree, ast.List) or not tree.elts:
            return ExtractedToolCalls(content=text)
        calls = [_call(node) for node in tree.elts]
        if any(call is None for call in calls):
            return ExtractedToolCalls(content=text)
        return ExtractedToolCalls(content=None, calls=calls)

    def partial(self, text: str) -> PartialToolCalls:
        stripped = text.lstrip()
        if PYTHON_START.startswith(stripped):
            return PartialToolCalls(0)
        body = stripped.removeprefix(PYTHON_START).lstrip()
        if not body.startswith("["):
            return PartialToolCalls(0 if not body else len(text))
        result = PartialToolCalls(0)
        position = 1
        while True:
            match = _NAME.match(body, position)
            if match is None:
                return result
            end = _closing_paren(body, match.end())
            if end is None:
                result.calls.append(PartialCall(match.group(1), "", False))
                return result
            call = _call_text(body[match.start(1) : end])
            if call is None:
                result.calls.append(PartialCall(None, "", False))  # malformed: nothing more streams
                return result
            result.calls.append(PartialCall(call.name, call.arguments, True))
            position = end


def _body(text: str) -> str:
    return text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()


def _call_text(source: str) -> ParsedCall | None:
    try:
        return _call(ast.parse(source, mode="eval").body)
    except (SyntaxError, ValueError):
        return None


def _call(node: ast.expr) -> ParsedCall | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = ast.unparse(node.func)
    try:
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
    except ValueError:
        return None
    if None in arguments:  # **kwargs
        return None
    try:
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))
    except TypeError:  # a literal JSON has no form for (a set, bytes)
        return None


def _closing_paren(text: str, position: int) -> int | None:
    """The index after the ``)`` closing the call whose arguments start at ``position``."""
    depth, quote = 1, None
    while position < len(text):
        char = text[position]
        if quote is not None:
            if char == "\\":
                position += 1
            elif char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return position + 1
        position += 1
    return None
