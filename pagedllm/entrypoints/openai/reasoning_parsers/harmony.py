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

The whole text so far is re-read at each delta and what became certain since is sent, so what was
sent is never taken back and a streamed reply equals an unstreamed one.
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
        self._sent = ReasoningDelta()

    def feed(self, delta_text: str) -> ReasoningDelta:
        self._text += delta_text
        return self._since_sent(split_harmony(self._text, finished=False))

    def finish(self) -> ReasoningDelta:
        return self._since_sent(split_harmony(self._text, finished=True))

    def _since_sent(self, whole: ReasoningDelta) -> ReasoningDelta:
        sent, self._sent = self._sent, whole
        return ReasoningDelta(whole.reasoning[len(sent.reasoning) :], whole.content[len(sent.content) :])


def split_harmony(text: str, finished: bool) -> ReasoningDelta:
    """(reasoning, answer) of ``text`` as far as it is certain; all of it once ``finished``."""
    result = ReasoningDelta()
    position = 0
    while position < len(text):
        rest = text[position:]
        if not rest.startswith((START, CHANNEL)):
            may_be_markup = any(held_prefix_len(rest, marker) == len(rest) for marker in (START, CHANNEL))
            if may_be_markup and not finished:
                break
            result.content += rest  # plain text, or the rest after a malformed message
            break
        header_end = rest.find(MESSAGE)
        channel_at = rest.find(CHANNEL)
        if header_end < 0 or channel_at < 0 or channel_at > header_end:
            if not finished and header_end < 0:
                break  # the header is still being written
            result.content += rest
            break
        header = rest[channel_at + len(CHANNEL) : header_end].split()
        if not header or header[0] not in CHANNELS:
            result.content += rest
            break
        recipient = _RECIPIENT.search(rest[:header_end])
        body_start = header_end + len(MESSAGE)
        end_at, end = min(
            ((rest.find(e, body_start), e) for e in ENDS if e in rest[body_start:]), default=(-1, "")
        )
        if end_at >= 0:
            body = rest[body_start:end_at]
        else:
            body = rest[body_start:]
            if not finished:
                body = body[: len(body) - max(held_prefix_len(body, e) for e in ENDS)]
        _route(header[0], recipient.group(1) if recipient else None, body, end, result)
        if end_at < 0:
            break
        position += end_at + len(end)
    return result


def _route(channel: str, recipient: str | None, body: str, end: str, result: ReasoningDelta) -> None:
    if channel == "analysis":
        result.reasoning += body
    elif channel == "commentary" and recipient is not None and recipient.startswith("functions."):
        result.content += f"{CHANNEL}commentary to={recipient}{MESSAGE}{body}{end}"
    else:
        result.content += body
