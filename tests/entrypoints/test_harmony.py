"""gpt-oss's harmony format: the ``openai_gptoss`` reasoning parser and the ``openai`` tool-call
parser on literal outputs, whole and streamed in arbitrary deltas, through ChatOutputParser as
the server uses them. Expected values are the literal pieces the outputs are built from."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from pagedllm.entrypoints.openai.chat_output import ChatDelta, ChatOutputParser
from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

THINK, ANSWER = "The user greets me. 2 < 3.", "Hello there!"
FINAL = f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
WHOLE = f"<|channel|>analysis<|message|>{THINK}<|end|>{FINAL}"
CALL = {"city": "Paris"}
CALL_TEXT = (
    f"<|channel|>analysis<|message|>{THINK}<|end|>"
    f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    f"{json.dumps(CALL)}<|call|>"
)

# (output, reasoning, content)
CASES = [
    (WHOLE, THINK, ANSWER),
    (f"<|channel|>final<|message|>{ANSWER}", "", ANSWER),  # no analysis; cut before <|return|>
    (f"<|channel|>analysis<|message|>{THINK}", THINK, ""),  # cut off by max_tokens
    (
        f"<|channel|>commentary<|message|>Checking.<|end|>{FINAL}",
        "",
        f"Checking.{ANSWER}",
    ),
    (ANSWER, "", ANSWER),  # no harmony markup at all
    (f"<|channel|>analysis<|message|>{THINK}<|end|>\n{FINAL}", THINK, ANSWER),  # whitespace between
    ("<|start|>user<|message|>no channel<|end|>", "", "<|start|>user<|message|>no channel<|end|>"),
    (
        f"<|channel|>analysis<|message|>{THINK}<|end|><|channel|>secret<|message|>x<|end|>",
        THINK,
        "<|channel|>secret<|message|>x<|end|>",
    ),
    ("<|channel|>analysis no message", "", "<|channel|>analysis no message"),
    ("<|chan", "", "<|chan"),
]


def _pieces(text: str):
    rng = random.Random(len(text))
    yield list(range(1, len(text)))
    for k in (1, 3, 8):
        for _ in range(3):
            yield sorted(rng.sample(range(1, len(text)), min(k, len(text) - 1)))


@pytest.mark.parametrize("name", ["openai_gptoss", "gpt_oss", "harmony"])
@pytest.mark.parametrize("text, reasoning, content", CASES)
def test_channels_whole_and_streamed(name, text, reasoning, content):
    whole = REASONING_PARSERS[name]().parse(text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for cuts in _pieces(text):
        parser = REASONING_PARSERS[name]()
        bounds = [0, *cuts, len(text)]
        streamed = [parser.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
        streamed.append(parser.finish())
        assert ("".join(d.reasoning for d in streamed), "".join(d.content for d in streamed)) == (
            reasoning,
            content,
        )


def test_reasoning_streams_before_content():
    parser = REASONING_PARSERS["openai_gptoss"]()
    assert parser.feed("<|channel|>analysis<|message|>Let me").reasoning == "Let me"
    assert parser.feed(" think<|en").reasoning == " think"  # "<|en" may be <|end|>
    delta = parser.feed("d|><|start|>assistant<|channel|>final<|message|>Hi")
    assert (delta.reasoning, delta.content) == ("", "Hi")


def _parser(name: str = "openai_gptoss") -> ChatOutputParser:
    return ChatOutputParser(REASONING_PARSERS[name](), TOOL_PARSERS["openai"]([]))


def _chat(text: str, cuts: list[int]) -> tuple[ChatDelta, bool]:
    """The deltas of ``text`` fed in pieces cut at ``cuts``, joined; and whether it called tools."""
    parser = _parser()
    bounds = [0, *cuts, len(text)]
    total = ChatDelta()
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        delta = parser.feed(text[a:b], finished=i == len(bounds) - 2)
        total.reasoning += delta.reasoning
        total.content += delta.content
        total.tool_calls += delta.tool_calls
    return total, parser.called


def test_tool_call_whole_and_streamed():
    reasoning, content, calls = _parser().parse_whole(CALL_TEXT)
    assert (reasoning, content) == (THINK, None)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", CALL)]
    for cuts in _pieces(CALL_TEXT):
        total, called = _chat(CALL_TEXT, cuts)
        assert (total.reasoning, total.content, called) == (THINK, "", True)
        assert [d.name for d in total.tool_calls if d.id] == ["get_weather"]
        assert json.loads("".join(d.arguments for d in total.tool_calls)) == CALL


def test_recipient_before_the_channel_and_two_calls():
    text = "".join(
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        f"{json.dumps({'city': c})}<|call|>"
        for c in ("Paris", "Rome")
    )
    _, content, calls = _parser("harmony").parse_whole(text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]


def test_malformed_call_is_content():
    text = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": }<|call|>'
    normalized = '<|channel|>commentary to=functions.get_weather<|message|>{"city": }<|call|>'
    _, content, calls = _parser().parse_whole(text)
    assert (content, calls) == (normalized, [])
    total, called = _chat(text, list(range(1, len(text))))
    assert not called and total.content == normalized
