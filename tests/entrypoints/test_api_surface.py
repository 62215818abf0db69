"""The API surface a vLLM user calls beyond plain chat, through the real server and the official
``openai`` client: reasoning separation (``--reasoning-parser``), auto tool calls streamed as
deltas, ``reasoning_effort``, advisory fields, and a missing route's 404.

The server is conftest's ``surface_server``: a tiny random Llama with a thinking chat template; a
regex (structured outputs) makes it write exactly the text a test needs, so what is checked is
how the server reads that text, against the literal text itself.
"""

from __future__ import annotations

import json
import re

import openai
import pytest

PLAIN_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"

MESSAGES = [{"role": "user", "content": "Hi"}]
REASONING, ANSWER = "\nThe user greets me.\n", "Hello there!"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris"}},
    {"name": "get_weather", "arguments": {"city": "Rome"}},
]


def forced(text: str) -> dict:
    """extra_body that makes the model write exactly ``text``, then end."""
    return {"structured_outputs": {"regex": re.escape(text)}}


@pytest.fixture(scope="module")
def server(surface_server):
    return surface_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)


def _chat(client, stream=False, **kwargs):
    return client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, stream=stream, **kwargs
    )


def test_reasoning_is_separated_whole_and_streamed(client):
    text = f"<think>{REASONING}</think>\n\n{ANSWER}"
    message = _chat(client, extra_body=forced(text)).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (REASONING, ANSWER)
    reasoning, content, num_reasoning_chunks = "", "", 0
    for chunk in _chat(client, stream=True, extra_body=forced(text)):
        for choice in chunk.choices:
            delta_reasoning = (choice.delta.model_extra or {}).get("reasoning_content")
            num_reasoning_chunks += bool(delta_reasoning)
            reasoning += delta_reasoning or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (REASONING, ANSWER)
    assert num_reasoning_chunks > 1  # streamed as it is written, not held to the end


def test_an_answer_without_thinking_is_all_content(client):
    message = _chat(client, extra_body=forced(ANSWER)).choices[0].message
    assert message.content == ANSWER and message.model_extra["reasoning_content"] is None


def _tool_text() -> str:
    blocks = "".join(f"<tool_call>\n{json.dumps(call)}\n</tool_call>\n" for call in CALLS)
    return f"<think>I need the weather.</think>\n\nLet me look.\n{blocks}"


def test_parallel_tool_calls_after_reasoning_whole(client):
    choice = _chat(client, tools=TOOLS, tool_choice="auto", extra_body=forced(_tool_text())).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    assert choice.message.model_extra["reasoning_content"] == "I need the weather."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [(c["name"], c["arguments"]) for c in CALLS]
    assert len({c.id for c in choice.message.tool_calls}) == 2


def test_tool_call_arguments_stream_as_deltas(client):
    calls: dict[int, dict] = {}
    num_argument_deltas, finish, content = 0, None, ""
    for chunk in _chat(client, stream=True, tools=TOOLS, tool_choice="auto", extra_body=forced(_tool_text())):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.id:
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                calls[delta.index]["arguments"] += delta.function.arguments or ""
                num_argument_deltas += bool(delta.function.arguments)
    assert finish == "tool_calls" and content.strip() == "Let me look."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c["name"], c["arguments"]) for c in CALLS
    ]
    assert num_argument_deltas > len(CALLS)  # arguments arrive in pieces as the model writes them


def test_malformed_tool_call_comes_back_as_text(client):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    for stream in (False, True):
        response = _chat(client, stream=stream, tools=TOOLS, tool_choice="auto", extra_body=forced(text))
        if stream:
            # The call was announced once its name was written; when its JSON broke, the text
            # came after it as content, and the choice ends as a reply, not a call.
            chunks = [c for c in response if c.choices]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            content = response.choices[0].message.content
            assert not response.choices[0].message.tool_calls
            assert response.choices[0].finish_reason == "stop"
        assert content == text


def test_reasoning_effort_goes_to_a_template_that_takes_it(client):
    plain = _chat(client, extra_body=forced(ANSWER)).usage.prompt_tokens
    low = _chat(client, reasoning_effort="low", extra_body=forced(ANSWER)).usage.prompt_tokens
    assert low > plain  # the template rendered "Reasoning effort: low"
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, reasoning_effort="low", extra_body={"chat_template": PLAIN_TEMPLATE})
    assert error.value.body["param"] == "reasoning_effort"


def test_advisory_fields_are_accepted_and_output_changing_ones_refused(client, server):
    response = _chat(
        client,
        prompt_cache_key="conversation-1",
        safety_identifier="user-hash",
        verbosity="low",
        metadata={"run": "1"},
        store=False,
        modalities=["text"],
        extra_body=forced(ANSWER),
    )
    assert response.choices[0].message.content == ANSWER
    assert "accepting the advisory field 'prompt_cache_key'" in server.log_tail(100_000)
    for field, value in (("modalities", ["text", "audio"]), ("web_search_options", {})):
        with pytest.raises(openai.BadRequestError) as error:
            _chat(client, extra_body={field: value})
        assert error.value.body["param"] == field


def test_a_route_that_does_not_exist_is_named(server):
    status, _, body = server.request("POST", "/v1/audio/speech", {"input": "x"})
    error = json.loads(body)["error"]
    assert status == 404 and "POST /v1/audio/speech" in error["message"]
    assert server.request("POST", "/v1/audio/speech", {"input": "x"}, authorize=False)[0] == 401
