"""What a reasoning parser gives: per text delta of the output, the part that is reasoning and the
part that is the answer.

A parser is made per output sequence and fed the output's text deltas in order (``feed``), then
``finish`` once the sequence ends. Text that may be the start of a tag the parser waits for is
held back until the next delta tells; ``finish`` releases it. The whole output at once
(``parse``) goes through the same steps, so a streamed answer and an unstreamed one always
agree.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __add__(self, other: ReasoningDelta) -> ReasoningDelta:
        return ReasoningDelta(self.reasoning + other.reasoning, self.content + other.content)


class ReasoningParser(abc.ABC):
    # The format is made of special tokens (gpt-oss's harmony): they must stay in the text.
    keeps_special_tokens: bool = False

    @abc.abstractmethod
    def feed(self, delta_text: str) -> ReasoningDelta:
        """The reasoning and content that ``delta_text`` (the output's next text) makes certain."""

    @abc.abstractmethod
    def finish(self) -> ReasoningDelta:
        """Whatever was held back, once the output has ended."""

    def parse(self, text: str) -> ReasoningDelta:
        """A whole output: (reasoning, content)."""
        return self.feed(text) + self.finish()
