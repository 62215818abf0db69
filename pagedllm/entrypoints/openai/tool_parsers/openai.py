"""gpt-oss's tool calls (vLLM's ``openai`` tool-call parser): harmony ``commentary`` messages to a
function, ``<|channel|>commentary to=functions.NAME [<|constrain|>json]<|message|>{...}<|call|>``,
one per call. The ``openai_gptoss`` reasoning parser passes them on in the answer in this shape;
the special tokens stay in the text (``keeps_special_tokens``).
"""

from __future__ import annotations

import re

from pagedllm.entrypoints.openai.text_markers import held_prefix_len
from pagedllm.entrypoints.openai.tool_parsers.base import (
    FinishedCallsParser,
    PartialCall,
    PartialToolCalls,
    tagged_calls,
)

CALL_START, MESSAGE, CALL_END = "<|channel|>commentary to=functions.", "<|message|>", "<|call|>"
_NAME = re.compile(r"[^\s<]+")


class OpenAIToolParser(FinishedCallsParser):
    keeps_special_tokens = True
    marker = CALL_START

    def partial(self, text: str) -> PartialToolCalls:
        return tagged_calls(text, CALL_START, CALL_END, _read_call)


def _read_call(text: str, body_start: int, body_end: int) -> PartialCall:
    done = text.startswith(CALL_END, body_end)
    message_at = text.find(MESSAGE, body_start, body_end)
    if message_at < 0:
        return PartialCall(None, "", False)
    name = _NAME.match(text, body_start, message_at)
    arguments = text[message_at + len(MESSAGE) : body_end]
    if not done:  # the arguments' end may be the start of <|call|>
        arguments = arguments[: len(arguments) - held_prefix_len(arguments, CALL_END)]
    arguments = arguments.strip()
    return PartialCall(name.group() if name else None, arguments if arguments.startswith("{") else "", done)
