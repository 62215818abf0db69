"""Tool calling: what ``tool_choice`` asks of the output, and the calls read back from it.

``required`` and a named function are enforced with structured outputs: the output is JSON that a
schema built from the tools accepts (a list of ``{"name", "parameters"}`` for ``required``, the
function's arguments for a named one), so it always parses. ``auto`` lets the model choose and
reads its calls with the server's ``--tool-call-parser`` (``chat_output``, streamed as they are
written); ``none`` never returns calls.
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.chat_output import ChatOutputParser
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from pagedllm.entrypoints.openai.tool_parsers.streaming import new_tool_call_id
from pagedllm.sampling_params import StructuredOutputsParams

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def tool_mode(request: ChatCompletionRequest, parser: object | None) -> str:
    """'none', 'auto' (the parser reads calls), 'required' or 'named'."""
    if not request.tools:
        if request.tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return "none"
    choice = request.tool_choice or "auto"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {tool.function.name for tool in request.tools}:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        return "named"
    if choice == "auto" and parser is None:
        raise ValueError(
            'tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
            '--tool-call-parser; "required" or a named function work without'
        )
    return choice


def tool_constraint(request: ChatCompletionRequest, mode: str) -> StructuredOutputsParams | None:
    if mode == "named":
        name = request.tool_choice.function.name
        tool = next(tool for tool in request.tools if tool.function.name == name)
        return StructuredOutputsParams(json=tool.function.parameters or ANY_OBJECT)
    if mode != "required":
        return None
    call_schemas = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or ANY_OBJECT,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in request.tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call_schemas}}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def extract_tool_calls(
    request: ChatCompletionRequest, mode: str, text: str
) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished output whose calls a constraint shaped (``required``,
    ``named``); other outputs are read by a ChatOutputParser."""
    if mode == "named":
        return None, [_tool_call(request.tool_choice.function.name, text)]
    if mode == "required":
        try:
            calls = json.loads(text)
        except ValueError:
            return text, []  # cut by max_tokens: the constraint could not finish
        return None, [_tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
    return text, []


def parse_whole_output(parser: ChatOutputParser, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
    """(reasoning, content, tool calls) of a finished output."""
    reasoning, content, calls = parser.parse_whole(text)
    return reasoning, content, [_tool_call(call.name, call.arguments) for call in calls]


def _tool_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=new_tool_call_id(), function=FunctionCall(name=name, arguments=arguments))
