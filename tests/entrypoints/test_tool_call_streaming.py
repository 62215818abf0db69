"""Every tool-call parser on literal model outputs: whole (``extract``) and streamed in arbitrary
deltas (``ToolCallStreamer``), which must agree; malformed outputs come back as text."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCallStreamer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "opts": {"type": "object"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
WEATHER = {"city": "Paris", "days": 3, "opts": {"unit": "C", "note": 'a } and a " inside'}}
TIME = {"zone": "UTC"}

# parser -> (model output with two calls after some text, content the calls leave)
OUTPUTS = {
    "hermes": (
        "Let me check.\n<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": WEATHER})
        + "\n</tool_call>\n<tool_call>\n"
        + json.dumps({"name": "get_time", "arguments": TIME})
        + "\n</tool_call>",
        "Let me check.",
    ),
    "llama3_json": (
        "<|python_tag|>"
        + json.dumps({"name": "get_weather", "parameters": WEATHER})
        + "; "
        + json.dumps({"name": "get_time", "parameters": TIME}),
        None,
    ),
    "mistral": (
        "[TOOL_CALLS]"
        + json.dumps(
            [{"name": "get_weather", "arguments": WEATHER}, {"name": "get_time", "arguments": TIME}]
        ),
        None,
    ),
    "pythonic": (
        "[get_weather(city='Paris', days=3, opts={'unit': 'C', 'note': 'a } and a \" inside'}), "
        "get_time(zone='UTC')]",
        None,
    ),
    "qwen3_coder": (
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        '<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{"unit": "C", "note": "a } and a \\" inside"}\n'
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n"
        "</parameter>\n</function>\n</tool_call>",
        "Let me check.",
    ),
}
MISTRAL_V11 = (
    "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(WEATHER) + "[TOOL_CALLS]get_time[ARGS]" + json.dumps(TIME)
)


def _stream(parser_name: str, text: str, cuts: list[int]) -> tuple[str, list[dict], list[int]]:
    """(content, calls joined by index, the order of their first deltas) of ``text`` fed in the
    pieces that ``cuts`` make."""
    streamer = ToolCallStreamer(TOOL_PARSERS[parser_name](TOOLS))
    content, calls, first_seen = "", {}, []
    bounds = [0, *sorted(cuts), len(text)]
    pieces = [streamer.feed(text[a:b]) for a, b in itertools.pairwise(bounds)] + [streamer.finish()]
    for piece_content, deltas in pieces:
        content += piece_content
        for delta in deltas:
            if delta.id is not None:
                assert delta.index not in calls and delta.name, "a call is announced once, with its name"
                calls[delta.index] = {"id": delta.id, "name": delta.name, "arguments": ""}
                first_seen.append(delta.index)
            calls[delta.index]["arguments"] += delta.arguments
    return content, [calls[i] for i in sorted(calls)], first_seen


def _splits(text: str) -> list[list[int]]:
    rng = random.Random(len(text))
    return [[], list(range(1, len(text)))] + [
        rng.sample(range(1, len(text)), k) for k in (1, 3, 10, len(text) // 4) for _ in range(3)
    ]


@pytest.mark.parametrize("parser_name", sorted(OUTPUTS))
def test_two_calls_whole_and_streamed_in_any_pieces(parser_name):
    text, expected_content = OUTPUTS[parser_name]
    extracted = TOOL_PARSERS[parser_name](TOOLS).extract(text)
    assert extracted.content == expected_content
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == [
        ("get_weather", WEATHER),
        ("get_time", TIME),
    ]
    for cuts in _splits(text):
        content, calls, first_seen = _stream(parser_name, text, cuts)
        assert content.strip() == (expected_content or "")
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            ("get_weather", WEATHER),
            ("get_time", TIME),
        ]
        assert first_seen == [0, 1] and len({c["id"] for c in calls}) == 2


def test_mistral_v11_format():
    extracted = TOOL_PARSERS["mistral"]().extract(MISTRAL_V11)
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == [
        ("get_weather", WEATHER),
        ("get_time", TIME),
    ]
    for cuts in _splits(MISTRAL_V11)[:6]:
        _, calls, _ = _stream("mistral", MISTRAL_V11, cuts)
        assert [json.loads(c["arguments"]) for c in calls] == [WEATHER, TIME]


def test_arguments_stream_before_the_call_ends():
    text, _ = OUTPUTS["hermes"]
    streamer = ToolCallStreamer(TOOL_PARSERS["hermes"](TOOLS))
    middle = text.index('"days"')
    _, deltas = streamer.feed(text[:middle])
    assert deltas[0].name == "get_weather" and deltas[0].id
    assert "".join(d.arguments for d in deltas).startswith('{"city": "Paris"')


@pytest.mark.parametrize(
    "parser_name, text",
    [
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
        ("llama3_json", '{"name": "get_time", "parameters": {"zone": '),
        ("llama3_json", '{"not": "a call"}'),
        ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone"'),
        ("pythonic", "[get_time(zone='UTC'), 3 + ]"),
        ("pythonic", "[get_time('UTC')]"),
        ("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n"),
        ("qwen3_coder", "<tool_call>\n<parameter=zone>\nUTC\n</parameter>\n</tool_call>"),
    ],
)
def test_malformed_output_is_text(parser_name, text):
    extracted = TOOL_PARSERS[parser_name](TOOLS).extract(text)
    assert extracted.calls == [] and extracted.content == text
    for cuts in _splits(text)[:5]:
        content, calls, _ = _stream(parser_name, text, cuts)
        if not calls:  # nothing was announced before the output broke: all of it is content
            assert content == text


@pytest.mark.parametrize("parser_name", sorted(OUTPUTS))
def test_plain_text_streams_as_content(parser_name):
    text = "The weather in Paris is mild [today], with {some} clouds."
    assert TOOL_PARSERS[parser_name](TOOLS).extract(text).calls == []
    streamer = ToolCallStreamer(TOOL_PARSERS[parser_name](TOOLS))
    first, _ = streamer.feed(text[:20])
    assert first == text[:20]  # nothing held back: it cannot become a call
    rest, _ = streamer.feed(text[20:])
    assert first + rest + streamer.finish()[0] == text


def test_qwen3_coder_types_parameters_by_the_schema():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    [call] = TOOL_PARSERS["qwen3_coder"](TOOLS).extract(text).calls
    assert json.loads(call.arguments) == {"city": "42", "days": 7}
