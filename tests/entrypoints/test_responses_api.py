"""/v1/responses with the official ``openai`` client (``responses.create``, ``responses.stream``,
``responses.parse``) and LangChain's ``ChatOpenAI(use_responses_api=True)``, against conftest's
``surface_server``. A regex (vLLM's structured_outputs extra) makes the tiny model write the
exact text a test needs."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

REASONING, ANSWER = "Greeting back.", "Hello there!"
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris"}},
    {"name": "get_weather", "arguments": {"city": "Rome"}},
]


def forced(text: str) -> dict:
    return {"structured_outputs": {"regex": re.escape(text)}}


def tool_text() -> str:
    return "".join(f"<tool_call>\n{json.dumps(call)}\n</tool_call>\n" for call in CALLS)


@pytest.fixture(scope="module")
def client(surface_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=surface_server.url + "/v1", api_key=surface_server.api_key, max_retries=0)


def _create(client, **kwargs):
    return client.responses.create(model="tiny", temperature=0, **kwargs)


def test_text_input_instructions_and_usage(client):
    plain = _create(client, input="Hi", extra_body=forced(ANSWER))
    assert plain.status == "completed" and plain.output_text == ANSWER
    assert [item.type for item in plain.output] == ["message"]
    usage = plain.usage
    assert usage.output_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    instructed = _create(client, input="Hi", instructions="Answer briefly.", extra_body=forced(ANSWER))
    assert instructed.instructions == "Answer briefly." and instructed.usage.input_tokens > usage.input_tokens
    messages = _create(
        client,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        extra_body=forced(ANSWER),
    )
    assert messages.usage.input_tokens == usage.input_tokens  # the same prompt as the text input


def test_max_output_tokens_makes_an_incomplete_response(client):
    response = _create(client, input="Hi", max_output_tokens=3, extra_body=forced(ANSWER * 3))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_reasoning_item_whole_and_streamed(client):
    text = f"<think>{REASONING}</think>\n\n{ANSWER}"
    response = _create(client, input="Hi", extra_body=forced(text))
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
    assert message.type == "message" and response.output_text == ANSWER
    with client.responses.stream(model="tiny", input="Hi", temperature=0, extra_body=forced(text)) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [event.type for event in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert types.count("response.reasoning_text.delta") > 1 and types.count("response.output_text.delta") > 1
    streamed_reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed_reasoning == REASONING and final.output_text == ANSWER
    assert final.usage.output_tokens == response.usage.output_tokens  # the same text, counted streamed
    assert [e.sequence_number for e in events] == list(range(len(events)))


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    sunny: bool


def test_json_schema_text_format_parses(client):
    parsed = client.responses.parse(model="tiny", input="Weather?", text_format=Weather, max_output_tokens=40)
    assert isinstance(parsed.output_parsed, Weather)
    with client.responses.stream(
        model="tiny", input="Weather?", text_format=Weather, max_output_tokens=40
    ) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Weather)


def test_function_calls_and_their_outputs_round_trip(client):
    first = _create(client, input="Weather in Paris and Rome?", tools=[TOOL], extra_body=forced(tool_text()))
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(c["name"], c["arguments"]) for c in CALLS]
    assert len({c.call_id for c in calls}) == 2
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "21 C"} for c in calls]
    # Through previous_response_id (the stored conversation), and with the items sent back whole.
    chained = _create(
        client, previous_response_id=first.id, input=outputs, tools=[TOOL], extra_body=forced(ANSWER)
    )
    assert chained.output_text == ANSWER and chained.previous_response_id == first.id
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        *[c.model_dump() for c in calls],
        *outputs,
    ]
    resent = _create(client, input=items, tools=[TOOL], extra_body=forced(ANSWER))
    assert resent.usage.input_tokens == chained.usage.input_tokens  # the same conversation either way
    assert chained.usage.input_tokens > first.usage.input_tokens + len(outputs)


def test_function_call_arguments_stream_as_deltas(client):
    with client.responses.stream(
        model="tiny", input="Weather?", tools=[TOOL], temperature=0, extra_body=forced(tool_text())
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert sum(e.type == "response.function_call_arguments.delta" for e in events) > len(CALLS)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [c["arguments"] for c in CALLS]
    assert [json.loads(i.arguments) for i in final.output if i.type == "function_call"] == [
        c["arguments"] for c in CALLS
    ]


def test_stored_responses_are_retrieved_and_unstored_ones_are_not(client, surface_server):
    stored = _create(client, input="Hi", extra_body=forced(ANSWER))
    assert client.responses.retrieve(stored.id).output_text == ANSWER
    unstored = _create(client, input="Hi", store=False, extra_body=forced(ANSWER))
    with pytest.raises(openai.NotFoundError) as error:
        _create(client, input="Hi", previous_response_id=unstored.id)
    assert error.value.body["param"] == "previous_response_id" and unstored.id in error.value.body["message"]
    status, _, _ = surface_server.request("POST", "/v1/responses", {"input": "Hi"}, authorize=False)
    assert status == 401


@pytest.mark.parametrize(
    "fields, param, named",
    [
        ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools", "file_search"),
        ({"tools": [{"type": "computer_use_preview"}]}, "tools", "computer_use_preview"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "input_image",
        ),
        ({"background": True}, "background", "background"),
    ],
)
def test_what_this_server_cannot_run_is_a_400_naming_it(client, fields, param, named):
    with pytest.raises(openai.BadRequestError) as error:
        _create(client, **{"input": "Hi", **fields})
    assert error.value.body["param"] == param and named in error.value.body["message"]


def test_langchain_chat_openai_with_the_responses_api(surface_server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=surface_server.url + "/v1",
        api_key=surface_server.api_key,
        model="tiny",
        temperature=0,
        max_retries=0,
        use_responses_api=True,
        extra_body=forced(ANSWER),
    )
    assert llm.invoke("Hi").text == ANSWER
    assert "".join(chunk.text for chunk in llm.stream("Hi")) == ANSWER
