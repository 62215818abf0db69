"""Mistral's formats, after the ``[TOOL_CALLS]`` special token (kept in the text: see
``keeps_special_tokens``):

- a JSON list, ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (tokenizers before v11);
- ``[TOOL_CALLS]name[ARGS]{...}``, repeated per call (v11 and later).
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.text_markers import held_prefix_len
from pagedllm.entrypoints.openai.tool_parsers.base import (
    FinishedCallsParser,
    PartialCall,
    PartialToolCalls,
    partial_json_call,
    value_end,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
ARGUMENTS_KEYS = ("arguments", "parameters")


class MistralToolParser(FinishedCallsParser):
    keeps_special_tokens = True
    marker = TOOL_CALLS

    def partial(self, text: str) -> PartialToolCalls:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return PartialToolCalls(len(text) - held_prefix_len(text, TOOL_CALLS))
        result = PartialToolCalls(start)
        body = start + len(TOOL_CALLS)
        if text[body:].lstrip().startswith("["):
            result.calls = _json_list_calls(text, text.index("[", body) + 1)
            return result
        while start >= 0:
            call, end = _named_call(text, start + len(TOOL_CALLS))
            result.calls.append(call)
            start = -1 if end is None else text.find(TOOL_CALLS, end)
        return result


def _json_list_calls(text: str, position: int) -> list[PartialCall]:
    calls = []
    while True:
        while position < len(text) and text[position] in " \n\t,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return calls
        call, end = partial_json_call(text, position, ARGUMENTS_KEYS)
        calls.append(call)
        if end is None:
            return calls
        position = end


def _named_call(text: str, position: int) -> tuple[PartialCall, int | None]:
    """``name[ARGS]{...}`` from ``position``: the call so far and its end (None while open)."""
    args_at = text.find(ARGS, position)
    if args_at < 0:
        return PartialCall(None, "", False), None
    name = text[position:args_at].strip()
    start = args_at + len(ARGS)
    while start < len(text) and text[start] in " \n\t":
        start += 1
    end = value_end(text, start)
    arguments = text[start : end if end is not None else len(text)].rstrip()
    return PartialCall(name or None, arguments if arguments.startswith("{") else "", end is not None), end
