"""gpt-oss's harmony format through the real server and the official ``openai`` client
(``--reasoning-parser openai_gptoss --tool-call-parser openai``).

The model is a tiny random Llama whose tokenizer has harmony's special tokens added and a
harmony-style chat template. A Lark grammar (structured outputs) makes it write exactly the text
a test needs, the markup as the special tokens themselves (so the server must keep them in the
text); what is checked is how the server reads that text, against the literal text itself.
"""

from __future__ import annotations

import copy
import json
import re

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.entrypoints.conftest import start_server

pytestmark = pytest.mark.slow

SPECIAL_TOKENS = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|constrain|>",
]
HARMONY_TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|>{{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{% elif m.tool_calls %}{% for c in m.tool_calls %}<|start|>assistant to=functions.{{ c.function.name }}"
    "<|channel|>commentary json<|message|>{{ c.function.arguments if c.function.arguments is string"
    " else c.function.arguments | tojson }}<|call|>{% endfor %}"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi"}]
THINK, ANSWER = "The user greets me.", "Hello there!"
OUTPUT = (
    f"<|channel|>analysis<|message|>{THINK}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL_OUTPUT = (
    "<|channel|>analysis<|message|>I need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)


def forced(text: str) -> dict:
    """extra_body that makes the model write exactly ``text`` (its special tokens as tokens)."""
    pieces = [p for p in re.split(r"(<\|[a-z]+\|>)", text) if p]
    rule = " ".join(p if p in SPECIAL_TOKENS else json.dumps(p) for p in pieces)
    return {"structured_outputs": {"grammar": f"start: {rule}"}}


@pytest.fixture(scope="module")
def server(smollm2_tokenizer, tmp_path_factory):
    tokenizer = copy.deepcopy(smollm2_tokenizer)  # the session's tokenizer stays as it is
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.chat_template = HARMONY_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tiny-harmony")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    args = [str(path), "--max-model-len", "512", "--swap-space", "0.1", "--served-model-name", "tiny"]
    args += [
        "--reasoning-parser",
        "openai_gptoss",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "openai",
    ]
    server = start_server(args, tmp_path_factory.mktemp("harmony") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _chat(client, stream=False, messages=MESSAGES, **kwargs):
    return client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, stream=stream, max_tokens=200, **kwargs
    )


def _streamed(response) -> tuple[str, str, dict[int, dict], str | None, int]:
    reasoning, content, calls, finish, num_reasoning_chunks = "", "", {}, None, 0
    for chunk in response:
        for choice in chunk.choices:
            delta_reasoning = (choice.delta.model_extra or {}).get("reasoning_content") or ""
            num_reasoning_chunks += bool(delta_reasoning)
            reasoning += delta_reasoning
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.id:
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    return reasoning, content, calls, finish, num_reasoning_chunks


def test_reasoning_is_separated_whole_and_streamed(client):
    message = _chat(client, extra_body=forced(OUTPUT)).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (THINK, ANSWER)
    reasoning, content, _, finish, num_reasoning_chunks = _streamed(
        _chat(client, True, extra_body=forced(OUTPUT))
    )
    assert (reasoning, content, finish) == (THINK, ANSWER, "stop")
    assert num_reasoning_chunks > 1  # streamed as it is written


def test_tool_call_round_trip(client):
    choice = _chat(client, tools=TOOLS, tool_choice="auto", extra_body=forced(CALL_OUTPUT)).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "I need the weather."
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})

    reasoning, content, calls, finish, _ = _streamed(
        _chat(client, True, tools=TOOLS, tool_choice="auto", extra_body=forced(CALL_OUTPUT))
    )
    assert (reasoning, content, finish) == ("I need the weather.", "", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"})
    ]

    # The call and its result go back through the harmony template; the model answers.
    messages = [
        *MESSAGES,
        choice.message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    answer = "<|channel|>final<|message|>It is sunny in Paris.<|return|>"
    reply = _chat(client, messages=messages, tools=TOOLS, tool_choice="auto", extra_body=forced(answer))
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == "It is sunny in Paris."
    assert reply.usage.prompt_tokens > _chat(client, extra_body=forced(answer)).usage.prompt_tokens


def test_malformed_output_is_content(client):
    text = "<|channel|>secret<|message|>not a channel<|end|>"
    for stream in (False, True):
        response = _chat(client, stream=stream, extra_body=forced(text))
        if stream:
            reasoning, content, _, finish, _ = _streamed(response)
        else:
            message = response.choices[0].message
            reasoning, content, finish = message.model_extra["reasoning_content"], message.content, "stop"
        assert (reasoning or "", content, finish) == ("", text, "stop")


def test_responses_reasoning_item_and_function_call(client):
    response = client.responses.create(model="tiny", input="Hi", temperature=0, extra_body=forced(OUTPUT))
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THINK
    assert message.type == "message" and response.output_text == ANSWER
    with client.responses.stream(
        model="tiny", input="Hi", temperature=0, extra_body=forced(OUTPUT)
    ) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THINK
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    call = client.responses.create(
        model="tiny",
        input="Weather?",
        temperature=0,
        tools=[{"type": "function", **TOOLS[0]["function"]}],
        extra_body=forced(CALL_OUTPUT),
    ).output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
