"""Tool-call parsers on the formats models write, and the schemas tool_choice enforces."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser
from pagedllm.entrypoints.openai.tools import extract_tool_calls, tool_constraint, tool_mode

TOOLS = [
    {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    },
    {"type": "function", "function": {"name": "g"}},
]


def test_hermes_calls_with_text_before_and_an_unclosed_last_block():
    text = (
        'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": {}}'
    )
    extracted = HermesToolParser().extract(text)
    assert extracted.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == [("f", {"x": 1}), ("g", {})]


@pytest.mark.parametrize(
    "text", ["no calls here", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>']
)
def test_hermes_text_without_a_well_formed_call_is_content(text):
    extracted = HermesToolParser().extract(text)
    assert extracted.content == text and extracted.calls == []


def test_hermes_holds_back_what_may_become_a_call():
    parser = HermesToolParser()
    assert parser.partial("Sure <tool").content_end == len("Sure ")
    assert parser.partial("x <tool_call>{").content_end == len("x ")
    assert parser.partial("Sure, the weather").content_end == len("Sure, the weather")


def test_llama3_json_one_or_several_calls():
    parser = Llama3JsonToolParser()
    one = parser.extract('{"name": "f", "parameters": {"x": 2}}')
    assert one.content is None and [(c.name, json.loads(c.arguments)) for c in one.calls] == [("f", {"x": 2})]
    several = parser.extract(
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": {}}'
    )
    assert [c.name for c in several.calls] == ["f", "g"]
    assert parser.extract("Paris is sunny.").calls == []
    assert parser.extract('{"name": "f", "parameters": {').content is not None
    assert parser.partial("  {").content_end == 0 and parser.partial("Hello").content_end == len("Hello")


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS, **fields)


def test_required_schema_accepts_calls_of_the_tools_only():
    request = _request(tool_choice="required")
    schema = json.loads(tool_constraint(request, tool_mode(request, None)).json)
    jsonschema.validate([{"name": "f", "parameters": {"x": 3}}, {"name": "g", "parameters": {}}], schema)
    for bad in ([], [{"name": "h", "parameters": {}}], [{"name": "f", "parameters": {"x": "no"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    content, calls = extract_tool_calls(request, "required", '[{"name": "f", "parameters": {"x": 3}}]')
    assert (
        content is None
        and calls[0].function.name == "f"
        and json.loads(calls[0].function.arguments) == {"x": 3}
    )


def test_named_choice_constrains_to_the_functions_arguments():
    request = _request(tool_choice={"type": "function", "function": {"name": "f"}})
    assert tool_mode(request, None) == "named"
    assert json.loads(tool_constraint(request, "named").json) == TOOLS[0]["function"]["parameters"]
    _, [call] = extract_tool_calls(request, "named", '{"x": 5}')
    assert call.function.name == "f" and call.function.arguments == '{"x": 5}'


@pytest.mark.parametrize(
    "fields, parser, message",
    [
        ({"tool_choice": "auto"}, None, "--enable-auto-tool-choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "zzz"}}}, None, "not in tools"),
    ],
)
def test_tool_choice_that_cannot_be_honoured_is_refused(fields, parser, message):
    with pytest.raises(ValueError, match=message):
        tool_mode(_request(**fields), parser)
    assert tool_mode(_request(tool_choice="auto"), HermesToolParser()) == "auto"
