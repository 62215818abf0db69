"""One chat choice's output text -> its reasoning, its answer and its tool calls, as deltas.

The serving code hands each choice's text deltas here, in order, with whether the choice has
ended; what comes back is what the client may be sent now. The reasoning parser sees the text
first; the tool-call parser sees only the answer (calls are never read inside the reasoning).
A reply that is not streamed is read whole by the same parsers (``parse_whole``), so
/v1/chat/completions, /v1/responses and /v1/messages read a model's output the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningDelta, ReasoningParser
from pagedllm.entrypoints.openai.tool_parsers import ToolCallDelta, ToolCallStreamer, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.base import ParsedCall


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    """Args:
    reasoning_parser: a fresh parser for this choice, or None (all text is the answer).
    tool_parser: the request's tool parser when the model may call tools (``tool_choice``
        "auto"), else None (the answer is content).
    """

    def __init__(self, reasoning_parser: ReasoningParser | None, tool_parser: ToolParser | None) -> None:
        self.reasoning = reasoning_parser
        self.tools = ToolCallStreamer(tool_parser) if tool_parser is not None else None

    def feed(self, delta_text: str, finished: bool) -> ChatDelta:
        """What ``delta_text`` (the choice's next text) makes certain; with ``finished``, also
        everything held back."""
        parsed = ReasoningDelta(content=delta_text)
        if self.reasoning is not None:
            parsed = self.reasoning.feed(delta_text)
            if finished:
                parsed += self.reasoning.finish()
        if self.tools is None:
            return ChatDelta(parsed.reasoning, parsed.content)
        content, calls = self.tools.feed(parsed.content)
        if finished:
            more_content, more_calls = self.tools.finish()
            content, calls = content + more_content, calls + more_calls
        return ChatDelta(parsed.reasoning, content, calls)

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def parse_whole(self, text: str) -> tuple[str | None, str | None, list[ParsedCall]]:
        """(reasoning, content, calls) of a finished output that was not streamed: a malformed
        call is all text here, since nothing of it was sent."""
        parsed = self.reasoning.parse(text) if self.reasoning is not None else ReasoningDelta(content=text)
        if self.tools is None:
            return parsed.reasoning or None, parsed.content, []
        extracted = self.tools.parser.extract(parsed.content)
        return parsed.reasoning or None, extracted.content, extracted.calls
