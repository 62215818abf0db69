"""The API surface beyond plain generation, with the embedded SmolLM2 through the real server:
structured outputs and tool calls with the official ``openai`` client (and LangChain's
``with_structured_output`` when installed), tokenizer endpoints, and vLLM's extra fields."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

MAX_MODEL_LEN = 512
MESSAGES = [{"role": "user", "content": "Tell me about Paris."}]
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "country": {"enum": ["France", "Spain", "Italy"]},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "capital"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def server(launch_server, smollm2_gguf):
    return launch_server(
        ["--max-model-len", str(MAX_MODEL_LEN), "--swap-space", "0.1", "--served-model-name", "smol"],
    )


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_json_schema_response_format_parses_and_conforms(client):
    response = client.chat.completions.create(
        model="smol",
        messages=MESSAGES,
        max_tokens=60,
        n=2,
        temperature=1.0,
        seed=3,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True},
        },
    )
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.message.content), CITY_SCHEMA)


def test_json_schema_streamed_and_json_object(client):
    stream = client.chat.completions.create(
        model="smol",
        messages=MESSAGES,
        max_tokens=60,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), CITY_SCHEMA)
    response = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": 'Reply with the JSON object {"a": 1}.'}],
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_guided_choice_and_regex(client):
    choice = client.completions.create(
        model="smol",
        prompt="Is the sky blue? Answer:",
        max_tokens=5,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(
        model="smol",
        prompt="A date:",
        max_tokens=12,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-0[1-9]"}},
    )
    assert __import__("re").fullmatch(r"20[0-9]{2}-0[1-9]", regex.choices[0].text)


def _check_call(call) -> None:
    assert call.id and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_yields_parsable_calls(client):
    response = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=80,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call)


def test_named_tool_choice_calls_that_function(client):
    response = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=40,
        temperature=0,
    )
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _check_call(call)


def test_streamed_tool_calls_reassemble(client):
    stream = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Weather in Rome, in C?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=80,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_tool_calls_and_results_in_the_history_render(client):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"},
    ]
    response = client.chat.completions.create(
        model="smol", messages=messages, tools=TOOLS, max_tokens=8, temperature=0, tool_choice="none"
    )
    assert response.choices[0].message.content


def test_tokenize_detokenize_and_model_routes(server, smollm2_tokenizer):
    status, _, body = server.request("POST", "/tokenize", {"prompt": "Hello world"})
    tokens = json.loads(body)["tokens"]
    assert status == 200 and tokens == smollm2_tokenizer("Hello world")["input_ids"]
    status, _, body = server.request("POST", "/detokenize", {"tokens": tokens})
    assert status == 200 and json.loads(body)["prompt"] == "Hello world"
    status, _, body = server.request("POST", "/tokenize", {"messages": MESSAGES})
    assert json.loads(body)["count"] > len(tokens)
    status, _, body = server.request("GET", "/v1/models")
    [card] = json.loads(body)["data"]
    assert card["id"] == card["root"] == "smol"
    assert server.request("GET", "/v1/models/smol")[0] == 200
    assert server.request("GET", "/v1/models/other")[0] == 404
    assert server.request("HEAD", "/health")[0] == 200


def test_logit_bias_bad_words_and_token_ids(client, smollm2_tokenizer):
    [forced] = smollm2_tokenizer(" banana", add_special_tokens=False)["input_ids"][:1]
    biased = client.completions.create(
        model="smol",
        prompt="Fruit:",
        max_tokens=3,
        temperature=0,
        logit_bias={str(forced): 100},
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "prompt_logprobs": 0},
    )
    choice = biased.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{forced}"] * 3
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(
        smollm2_tokenizer("Fruit:")["input_ids"]
    )
    plain = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    banned = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
        extra_body={"bad_words": ["Paris"]},
    )
    assert "Paris" in plain.choices[0].message.content and "Paris" not in banned.choices[0].message.content


def test_continuous_usage_stats_echo_and_continue_final_message(client):
    stream = client.completions.create(
        model="smol",
        prompt="One, two,",
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    usages = [chunk.usage.completion_tokens for chunk in stream if chunk.usage is not None]
    assert usages == sorted(usages) and usages[-1] == 4 and len(usages) >= 4
    response = client.chat.completions.create(
        model="smol",
        messages=[
            {"role": "user", "content": "Count to five."},
            {"role": "assistant", "content": "One, two,"},
        ],
        max_tokens=4,
        temperature=0,
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert response.choices[0].message.content.startswith("One, two,")


def test_langchain_with_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=12)
        country: str = Field(max_length=12)

    llm = langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        model="smol",
        temperature=0,
        max_tokens=60,
        max_retries=0,
    )
    for method in ("json_schema", "function_calling"):
        result = llm.with_structured_output(City, method=method).invoke("Describe Paris.")
        assert isinstance(result, City), method
