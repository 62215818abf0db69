"""What every tool-call parser gives: the text around the calls, and the calls."""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass, field
from typing import Any


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


class ToolParser(abc.ABC):
    """Finds the function calls a model wrote in its own format."""

    @abc.abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls: ...

    @abc.abstractmethod
    def may_start_call(self, text: str) -> bool:
        """Whether ``text`` (the output so far) is, or may grow into, the start of a call: a stream
        holds such text back until the output ends and the parser can tell."""


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
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))
