"""/v1/messages (Anthropic's Messages API) with the official ``anthropic`` client, against
conftest's ``surface_server``: system, text, thinking and tool_use/tool_result blocks, tools and
tool_choice, stop_sequences, streaming with Anthropic's events, count_tokens. A regex (vLLM's
structured_outputs extra) makes the tiny model write the exact text a test needs."""

from __future__ import annotations

import json
import re

import pytest

anthropic = pytest.importorskip("anthropic")

REASONING, ANSWER = "Greeting back.", "Hello there!"
MESSAGES = [{"role": "user", "content": "Hi"}]
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris"}},
    {"name": "get_weather", "arguments": {"city": "Rome"}},
]


def forced(text: str) -> dict:
    # Greedy, so that the same text is the same tokens (a regex admits several tokenizations).
    return {"structured_outputs": {"regex": re.escape(text)}, "temperature": 0}


def tool_text() -> str:
    return "".join(f"<tool_call>\n{json.dumps(call)}\n</tool_call>\n" for call in CALLS)


@pytest.fixture(scope="module")
def client(surface_server):
    return anthropic.Anthropic(base_url=surface_server.url, api_key=surface_server.api_key, max_retries=0)


def _create(client, **kwargs):
    return client.messages.create(**{"model": "tiny", "max_tokens": 100, "messages": MESSAGES, **kwargs})


def test_system_and_text_and_count_tokens(client):
    message = _create(client, system="Answer briefly.", extra_body=forced(ANSWER))
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == ANSWER
    assert message.stop_reason == "end_turn" and message.role == "assistant"
    counted = client.messages.count_tokens(model="tiny", system="Answer briefly.", messages=MESSAGES)
    assert counted.input_tokens == message.usage.input_tokens
    plain = client.messages.count_tokens(model="tiny", messages=MESSAGES)
    assert plain.input_tokens < counted.input_tokens


def test_thinking_block_whole_and_streamed(client):
    text = f"<think>{REASONING}</think>\n\n{ANSWER}"
    message = _create(client, extra_body=forced(text))
    thinking, answer = message.content
    assert (thinking.type, thinking.thinking) == ("thinking", REASONING)
    assert (answer.type, answer.text) == ("text", ANSWER)
    with client.messages.stream(
        model="tiny", max_tokens=100, messages=MESSAGES, extra_body=forced(text)
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [event.type for event in events]
    assert types[0] == "message_start" and types[-1] == "message_stop" and "message_delta" in types
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas.count("thinking_delta") > 1 and deltas.count("text_delta") > 1
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == ANSWER
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == message.usage.output_tokens


def test_stop_sequences_end_the_reply_and_are_named(client):
    message = _create(client, stop_sequences=["STOP"], extra_body=forced(ANSWER + " STOP and more"))
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "STOP"
    assert message.content[0].text == ANSWER + " "


def test_max_tokens_stop_reason(client):
    message = _create(client, max_tokens=3, extra_body=forced(ANSWER * 3))
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


def test_tool_use_and_tool_result_round_trip(client, surface_server):
    message = _create(
        client, max_tokens=160, tools=[TOOL], tool_choice={"type": "auto"}, extra_body=forced(tool_text())
    )
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use"
    assert [(u.name, u.input) for u in uses] == [(c["name"], c["arguments"]) for c in CALLS]
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "21 C"} for u in uses]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": message.content},
        {"role": "user", "content": results},
    ]
    reply = _create(client, max_tokens=20, messages=history, tools=[TOOL], extra_body=forced(ANSWER))
    assert reply.content[0].text == ANSWER
    # The conversation renders as its OpenAI form does: tool_use blocks as the assistant's tool
    # calls, tool_result blocks as tool messages.
    openai_form = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": u.id,
                    "type": "function",
                    "function": {"name": u.name, "arguments": json.dumps(u.input)},
                }
                for u in uses
            ],
        },
        *[{"role": "tool", "tool_call_id": u.id, "content": "21 C"} for u in uses],
    ]
    _, _, body = surface_server.request("POST", "/tokenize", {"messages": openai_form})
    assert (
        client.messages.count_tokens(model="tiny", messages=history).input_tokens == json.loads(body)["count"]
    )


def test_tool_use_input_streams_as_json_deltas(client):
    with client.messages.stream(
        model="tiny", max_tokens=160, messages=MESSAGES, tools=[TOOL], extra_body=forced(tool_text())
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    json_deltas = [
        e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(json_deltas) > len(CALLS)
    assert [b.input for b in final.content if b.type == "tool_use"] == [c["arguments"] for c in CALLS]
    assert final.stop_reason == "tool_use"


def test_tool_choice_any_calls_a_tool(client):
    message = _create(client, tools=[TOOL], tool_choice={"type": "any"}, extra_body={"temperature": 0})
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses, message
    assert all(u.name == "get_weather" and u.input["city"] in ("Paris", "Rome") for u in uses)
    assert message.stop_reason == "tool_use"


@pytest.mark.parametrize(
    "fields, named",
    [
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}
                ]
            },
            "'image' block",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ],
)
def test_what_this_server_cannot_run_is_a_400_naming_it(client, fields, named):
    with pytest.raises(anthropic.BadRequestError) as error:
        _create(client, **fields)
    assert named in str(error.value)


def test_the_api_key_is_required(surface_server):
    wrong = anthropic.Anthropic(base_url=surface_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        _create(wrong)
    assert (
        surface_server.request("POST", "/v1/messages/count_tokens", {"messages": MESSAGES}, authorize=False)[
            0
        ]
        == 401
    )
