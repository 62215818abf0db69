"""OpenAI's Responses API (``POST /v1/responses``): the request, and its input read as chat
messages.

A request becomes a chat completion request: ``instructions`` a system message, ``input`` (text,
or items: messages, ``function_call`` and ``function_call_output``) the messages after the
stored conversation of ``previous_response_id``, function ``tools`` chat tools, ``text.format``
a response format. Everything then runs through the chat path (template, tools, reasoning);
only the shape of the answer differs. What this server cannot run (a hosted tool, an image) is
a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.protocol import TopLevelRequest

# Hosted tools OpenAI runs on its side: a request naming one is refused here, by name.
SUPPORTED_TOOL_TYPES = ("function",)


class ResponsesRequest(TopLevelRequest):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    # Advisory, as on chat (protocol.ADVISORY_FIELDS), plus what only asks for output this server
    # does not produce (encrypted reasoning, hosted-tool results) or a truncation it never needs.
    metadata: dict[str, Any] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # vLLM's extras, as on chat.
    top_k: int | None = None
    seed: int | None = None
    structured_outputs: dict[str, Any] | None = None


class RequestFieldError(ValueError):
    """A request the chat path cannot run; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def chat_fields(request: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request's fields for ``request`` after the conversation ``history``
    (chat messages of the stored responses before it)."""
    fields: dict[str, Any] = {
        "messages": [*system_messages(request), *history, *input_messages(request.input)]
    }
    for name in ("temperature", "top_p", "top_k", "seed", "parallel_tool_calls", "structured_outputs"):
        if getattr(request, name) is not None:
            fields[name] = getattr(request, name)
    if request.max_output_tokens is not None:
        fields["max_tokens"] = request.max_output_tokens
    if request.tools:
        fields["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        fields["tool_choice"] = _chat_tool_choice(request.tool_choice)
    if request.text and request.text.get("format"):
        fields["response_format"] = _response_format(request.text["format"])
    if request.reasoning and request.reasoning.get("effort") is not None:
        fields["reasoning_effort"] = request.reasoning["effort"]
    return fields


def system_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    # Instructions apply to this response only: a later one's previous_response_id does not
    # carry them (OpenAI's rule), so they are not part of the stored conversation.
    return [{"role": "system", "content": request.instructions}] if request.instructions else []


def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive function calls join one assistant message."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": _role(index, item), "content": _text(index, item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": _string(index, item, "call_id"),
                "type": "function",
                "function": {
                    "name": _string(index, item, "name"),
                    "arguments": _string(index, item, "arguments"),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(index, output)
            messages.append(
                {"role": "tool", "tool_call_id": _string(index, item, "call_id"), "content": content}
            )
        elif kind != "reasoning":  # a reasoning item sent back is the model's own: templates drop it
            raise RequestFieldError(
                f"input[{index}] has type {kind!r}, which this server does not take", "input"
            )
    return messages


def _role(index: int, item: dict[str, Any]) -> str:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise RequestFieldError(f"input[{index}].role must be user, system, developer or assistant", "input")
    return role


def _text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestFieldError(f"input[{index}].content must be text or a list of text parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise RequestFieldError(
                f"input[{index}].content has a part of type {kind!r}: only text parts are supported", "input"
            )
        texts.append(part["text"])
    return "".join(texts)


def _string(index: int, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestFieldError(f"input[{index}].{key} must be a string", "input")
    return value


def _chat_tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    kind = tool.get("type")
    if kind not in SUPPORTED_TOOL_TYPES:
        raise RequestFieldError(
            f"tools[{index}] has type {kind!r}: this server runs no hosted tools, only function tools",
            "tools",
        )
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestFieldError(f"tool_choice {json.dumps(choice)[:200]} names no function tool", "tool_choice")


def _response_format(text_format: dict[str, Any]) -> dict[str, Any]:
    kind = text_format.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        keys = ("name", "description", "schema", "strict")
        return {
            "type": "json_schema",
            "json_schema": {key: text_format[key] for key in keys if key in text_format},
        }
    raise RequestFieldError(f"text.format has type {kind!r}: text, json_object or json_schema", "text")


# --- the response -----------------------------------------------------------------------------


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, Any] | None = None

    @classmethod
    def start(
        cls, request: ResponsesRequest, response_id: str, created_at: int, model: str
    ) -> ResponseObject:
        """The response as it begins (status in_progress, no output), echoing the request."""
        return cls(
            id=response_id,
            created_at=created_at,
            status="in_progress",
            model=model,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            tools=request.tools or [],
            tool_choice=request.tool_choice or "auto",
            parallel_tool_calls=request.parallel_tool_calls is not False,
            text=request.text or {"format": {"type": "text"}},
            reasoning=request.reasoning,
            previous_response_id=request.previous_response_id,
            store=request.store is not False,
            metadata=request.metadata,
        )
