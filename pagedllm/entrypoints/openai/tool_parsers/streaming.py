"""A growing output -> content deltas and tool-call deltas, as vLLM streams them: a call's first
delta carries its index, id, type and name (arguments ""), the next ones pieces of its arguments'
JSON text; a client joins a call's pieces by index. Several calls (parallel tool calls) get
indices 0, 1, ... in the order they are written.

Text before the calls streams as content as soon as the parser knows it is not a call; a call
is announced once its whole name is written. When the output ends, ``finish`` checks the whole
output with the parser's ``extract``: when its calls are not well-formed, the text not yet sent
comes back as content, never an error (a call announced before its JSON broke keeps what was
sent of it, as vLLM's streams do, and the finish reason stays "stop").
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from pagedllm.entrypoints.openai.tool_parsers.base import PartialCall, ToolParser


@dataclass
class ToolCallDelta:
    index: int
    # Set on a call's first delta only (with ``name``).
    id: str | None
    name: str | None
    arguments: str


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStreamer:
    """Feed one output sequence's text deltas in order, then ``finish`` once it ends."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._num_content_chars = 0
        # Per announced call: the arguments text sent so far.
        self._sent_arguments: list[str] = []
        self._malformed = False

    def feed(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        """The content and call deltas ``delta_text`` makes certain."""
        self.text += delta_text
        partial = self.parser.partial(self.text)
        content = self.text[self._num_content_chars : partial.content_end]
        self._num_content_chars = max(self._num_content_chars, partial.content_end)
        return content, self._call_deltas(partial.calls)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What was held back, once the output has ended."""
        if self.parser.extract(self.text).calls:
            return "", self._call_deltas(self.parser.partial(self.text).calls)
        # Not a well-formed call: the text not yet sent is the answer.
        self._malformed = True
        content = self.text[self._num_content_chars :]
        self._num_content_chars = len(self.text)
        return content, []

    @property
    def called(self) -> bool:
        """Whether the output calls tools (finish reason "tool_calls")."""
        return bool(self._sent_arguments) and not self._malformed

    def _call_deltas(self, calls: list[PartialCall]) -> list[ToolCallDelta]:
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:
                break  # announced in order: a later call waits for this one's name
            if index == len(self._sent_arguments):
                self._sent_arguments.append("")
                deltas.append(ToolCallDelta(index, new_tool_call_id(), call.name, ""))
            sent = self._sent_arguments[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                self._sent_arguments[index] = call.arguments
                deltas.append(ToolCallDelta(index, None, None, call.arguments[len(sent) :]))
        return deltas
