"""What every tool-call parser gives: the text around the calls and the calls, for a whole output
(``extract``) and for an output still growing (``partial``, which ``ToolCallStreamer`` turns into
vLLM's streamed tool-call deltas).

A parser is made per request, with the request's tools (``qwen3_coder`` reads the parameters'
types from them).
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.text_markers import held_prefix_len


@dataclass
class ParsedCall:
    name: str
    # JSON text of the arguments object.
    arguments: str


@dataclass
class ExtractedToolCalls:
    # The text outside the calls; None when there is none.
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass
class PartialCall:
    """A call as far as the output has written it."""

    # None until the whole name is written.
    name: str | None
    # The arguments' JSON text so far: it only grows (what is streamed is never taken back).
    arguments: str
    # The call's text is complete.
    done: bool


@dataclass
class PartialToolCalls:
    # How many characters from the start of the output are certainly content (text before the
    # calls); the text after them is calls, or held back until the parser can tell.
    content_end: int
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser(abc.ABC):
    """Finds the function calls a model wrote in its own format.

    Args:
        tools: the request's tools (OpenAI's ``{"type": "function", "function": {...}}`` dicts).
    """

    # The format uses special tokens (Mistral's [TOOL_CALLS]): they must stay in the text.
    keeps_special_tokens: bool = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    @abc.abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls of a finished output; none (the whole text as content) when it is not
        well-formed: a malformed call is returned as text, never an error."""

    @abc.abstractmethod
    def partial(self, text: str) -> PartialToolCalls:
        """What the output so far certainly is: its leading content and the calls begun."""


class FinishedCallsParser(ToolParser):
    """A format whose ``extract`` is its ``partial`` finished: the calls from the first ``marker``
    on, each made whole by ``finished`` (None: malformed, and the whole text is content)."""

    marker: str

    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(self.marker)
        if start < 0:
            return ExtractedToolCalls(content=text)
        return calls_after(text, start, [self.finished(call) for call in self.partial(text).calls])

    def finished(self, call: PartialCall) -> ParsedCall | None:
        return finished_call(call)


def finished_call(call: PartialCall) -> ParsedCall | None:
    """A call ``partial`` read, if it is done, named and its arguments are JSON (as ``parse_call``
    takes them: an object, or a string holding one); else None."""
    if not call.done or call.name is None:
        return None
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        return None  # parse_call would refuse it
    return parse_call(json.dumps({"name": call.name, "arguments": arguments}), ("arguments",))


def calls_after(text: str, start: int, calls: list[ParsedCall | None]) -> ExtractedToolCalls:
    """The calls that begin at ``start``, the text before it as the content; the whole text as
    the content when there is no call or one is malformed."""
    if not calls or any(call is None for call in calls):
        return ExtractedToolCalls(content=text)
    content = text[:start].strip()
    return ExtractedToolCalls(content=content or None, calls=[call for call in calls if call is not None])


def tagged_calls(
    text: str, start_tag: str, end_tag: str, read_call: Callable[[str, int, int], PartialCall]
) -> PartialToolCalls:
    """The calls of a format with one ``start_tag ... end_tag`` block per call, as far as they are
    written: ``read_call(text, body_start, body_end)`` reads one block's body (``body_end`` is the
    text's end while the block is open). Text that may still become ``start_tag`` is held back."""
    start = text.find(start_tag)
    if start < 0:
        return PartialToolCalls(len(text) - held_prefix_len(text, start_tag))
    result = PartialToolCalls(start)
    while start >= 0:
        end = text.find(end_tag, start)
        result.calls.append(read_call(text, start + len(start_tag), end if end >= 0 else len(text)))
        start = -1 if end < 0 else text.find(start_tag, end)
    return result


# --- a JSON object read as far as it is written -----------------------------------------------

_LITERAL = re.compile(r"-?[0-9][0-9.eE+\-]*|true|false|null")
_WHITESPACE = " \t\n\r"


def value_end(text: str, start: int) -> int | None:
    """The end of the JSON value starting at ``text[start]``, or None when it is not complete (or
    not JSON)."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first in "{[":
        depth, i = 0, start
        while i < len(text):
            char = text[i]
            if char == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            depth += char in "{["
            depth -= char in "}]"
            i += 1
            if depth == 0:
                return i
        return None
    match = _LITERAL.match(text, start)
    # A literal is complete only once something follows it ("12" may become "123").
    if match is None or match.end() >= len(text):
        return None
    return match.end()


def _string_end(text: str, start: int) -> int | None:
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def partial_object(text: str, start: int = 0) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The top-level members of the JSON object at ``text[start]`` written so far: key -> (value
    start, value end or None while unfinished); and the object's end, or None while open."""
    members: dict[str, tuple[int, int | None]] = {}
    i = _skip(text, start)
    if i >= len(text) or text[i] != "{":
        return members, None
    i += 1
    while True:
        i = _skip(text, i)
        if i >= len(text):
            return members, None
        if text[i] == "}":
            return members, i + 1
        if text[i] == ",":
            i += 1
            continue
        key_end = _string_end(text, i) if text[i] == '"' else None
        if key_end is None:
            return members, None
        key = json.loads(text[i:key_end])
        i = _skip(text, key_end)
        if i >= len(text) or text[i] != ":":
            return members, None
        value_start = _skip(text, i + 1)
        end = value_end(text, value_start)
        members[key] = (value_start, end)
        if end is None:
            return members, None
        i = end


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def partial_json_call(
    text: str, start: int, arguments_keys: tuple[str, ...]
) -> tuple[PartialCall, int | None]:
    """A call written as ``{"name": ..., <arguments key>: {...}}`` from ``text[start]`` on, as far
    as it is written, and the end of its object (None while open)."""
    members, end = partial_object(text, start)
    name = None
    name_span = members.get("name")
    if name_span is not None and name_span[1] is not None:
        value = json.loads(text[name_span[0] : name_span[1]])
        name = value if isinstance(value, str) else None
    arguments = ""
    key = next((k for k in arguments_keys if k in members), None)
    if key is not None:
        value_start, value_stop = members[key]
        if text.startswith("{", value_start):
            # An object streams as it is written: its text so far is a prefix of its whole text.
            arguments = text[value_start : value_stop if value_stop is not None else len(text)].rstrip()
        elif value_stop is not None and text.startswith('"', value_start):
            arguments = json.loads(text[value_start:value_stop])  # arguments sent as a JSON string
    elif end is not None:
        arguments = "{}"
    return PartialCall(name, arguments, end is not None), end


def parse_call(text: str, arguments_keys: tuple[str, ...]) -> ParsedCall | None:
    """A call from one JSON object ``{"name": ..., <arguments key>: {...}}``, or None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments: Any = next((value[key] for key in arguments_keys if key in value), {})
    if isinstance(arguments, str):
        return ParsedCall(value["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))
