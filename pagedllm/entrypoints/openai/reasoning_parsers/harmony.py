"""gpt-oss's harmony format (vLLM's ``openai_gptoss`` reasoning parser): an output is a series of
messages, each ``[<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]
<|message|>BODY`` ended by ``<|end|>``, ``<|call|>`` or ``<|return|>``.

- ``analysis`` bodies are the reasoning;
- ``final`` bodies, and ``commentary`` bodies with no recipient (a preamble to the user), are the
  answer;
- a ``commentary`` message to ``functions.NAME`` is a tool call: it goes on in the answer as
  ``<|channel|>commentary to=functions.NAME<|message|>ARGS<|call|>`` (the recipient moved into the
  header whichever side of ``<|channel|>`` the model wrote it) for the ``openai`` tool-call parser
  to read.

The markup is made of special tokens, so the text is decoded with them (``keeps_special_tokens``).
This parser reads the text rather than token ids through ``openai-harmony``'s StreamableParser:
that library's o200k_harmony encoding downloads its vocabulary at first use, which an offline
server cannot do. An output with no harmony markup is all answer; from the first markup that is
not a well-formed header (an unknown channel, a header never closed by ``<|message|>``) the rest
of the text is the answer as written, never an error. A message cut off by ``max_tokens`` keeps its
channel (its body so far streamed as it came).

Messages that have ended are read once; the one still being written is re-read at each delta and
what became certain since is sent, so what was sent is never taken back and a streamed reply
equals an unstreamed one.
"""

from __future__ import annotations

import re

from pagedllm.entrypoints.openai.reasoning_parsers.base import ReasoningDelta, ReasoningParser
from pagedllm.entrypoints.openai.text_markers import held_prefix_len

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
CHANNELS = ("analysis", "commentary", "final")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyReasoningParser(ReasoningParser):
    keeps_special_tokens = True

    def __init__(self) -> None:
        self._text = ""
        # Where the first message that has not ended starts, and what the ones before it were.
        self._position = 0
        self._ended = ReasoningDelta()
        self._sent = ReasoningDelta()

    def feed(self, delta_text: str) -> ReasoningDelta:
        self._text += delta_text
        return self._read(finished=False)

    def finish(self) -> ReasoningDelta:
        return self._read(finished=True)

    def _read(self, finished: bool) -> ReasoningDelta:
        ended, open_message, self._position = read_messages(self._text, self._position, finished)
        self._ended += ended
        whole, sent = self._ended + open_message, self._sent
        self._sent = whole
        return ReasoningDelta(whole.reasoning[len(sent.reasoning) :], whole.content[len(sent.content) :])


def read_messages(text: str, position: int, finished: bool) -> tuple[ReasoningDelta, ReasoningDelta, int]:
    """The messages of ``text`` from ``position`` on: (what the ended ones are, what is certain of
    the one still open, where that one starts). Once ``finished``, nothing is held back."""
    ended, open_message = ReasoningDelta(), ReasoningDelta()
    while position < len(text):
        begin = _skip_whitespace(text, position)
        if not text.startswith((START, CHANNEL), begin):
            rest = text[begin:] if len(text) - begin < len(CHANNEL) else None
            may_be_markup = rest is not None and (START.startswith(rest) or CHANNEL.startswith(rest))
            if not (may_be_markup and not finished):
                open_message.content += text[position:]  # plain text, or all after a malformed header
            break
        header_end = text.find(MESSAGE, begin)
        channel_at = text.find(CHANNEL, begin, header_end if header_end >= 0 else len(text))
        if header_end < 0 and not finished:
            break  # the header is still being written
        header = text[channel_at + len(CHANNEL) : header_end].split() if channel_at >= 0 else []
        if header_end < 0 or not header or header[0] not in CHANNELS:
            open_message.content += text[position:]
            break
        recipient = _RECIPIENT.search(text, begin, header_end)
        body_start = header_end + len(MESSAGE)
        found = [(at, end) for end in ENDS if (at := text.find(end, body_start)) >= 0]
        end_at, end = min(found) if found else (len(text), "")
        body = text[body_start:end_at]
        if not found and not finished:
            body = body[: len(body) - max(held_prefix_len(body, e) for e in ENDS)]
        _route(
            header[0], recipient.group(1) if recipient else None, body, end, ended if found else open_message
        )
        if not found:
            break
        position = end_at + len(end)
    return ended, open_message, position


def _skip_whitespace(text: str, position: int) -> int:
    """Past whitespace between messages (none in what gpt-oss writes, but harmless to allow)."""
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def _route(channel: str, recipient: str | None, body: str, end: str, result: ReasoningDelta) -> None:
    if channel == "analysis":
        result.reasoning += body
    elif channel == "commentary" and recipient is not None and recipient.startswith("functions."):
        result.content += f"{CHANNEL}commentary to={recipient}{MESSAGE}{body}{end}"
    else:
        result.content += body
