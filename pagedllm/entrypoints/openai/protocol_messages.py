"""Anthropic's Messages API (``POST /v1/messages``): the request, read as a chat request.

``system`` becomes a system message; a message's blocks become chat messages (``text`` its
content, an assistant's ``tool_use`` blocks its tool calls, a user's ``tool_result`` blocks tool
messages before its text); ``tools`` (``input_schema``) chat tools; ``tool_choice`` auto / any /
tool / none the chat's auto / required / named / none; ``stop_sequences`` stop strings;
``thinking`` the template's ``enable_thinking``. An image or document block, or a server tool
(web search, bash, ...), is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.protocol import TopLevelRequest
from pagedllm.entrypoints.openai.protocol_responses import RequestFieldError

__all__ = ["MessagesCountTokensRequest", "MessagesRequest", "RequestFieldError", "chat_fields"]


class MessagesCountTokensRequest(TopLevelRequest):
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(MessagesCountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # Advisory (Anthropic's bookkeeping).
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # vLLM's extra, as on chat.
    structured_outputs: dict[str, Any] | None = None


def chat_fields(request: MessagesCountTokensRequest) -> dict[str, Any]:
    """The chat completion request's fields for an Anthropic request."""
    messages = _system(request.system)
    for index, message in enumerate(request.messages):
        messages += _chat_messages(index, message)
    fields: dict[str, Any] = {"messages": messages}
    if request.tools:
        fields["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        fields.update(_tool_choice(request.tool_choice))
    if request.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": request.thinking.get("type") == "enabled"}
    if isinstance(request, MessagesRequest):
        fields["max_tokens"] = request.max_tokens
        if request.stop_sequences:
            fields["stop"] = request.stop_sequences
        for name in ("temperature", "top_p", "top_k", "structured_outputs"):
            if getattr(request, name) is not None:
                fields[name] = getattr(request, name)
    return fields


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    return [{"role": "system", "content": "".join(_block_text("system", i, b) for i, b in enumerate(system))}]


def _chat_messages(index: int, message: dict[str, Any]) -> list[dict[str, Any]]:
    role, content = message.get("role"), message.get("content")
    where = f"messages[{index}]"
    if role not in ("user", "assistant"):
        raise RequestFieldError(f"{where}.role must be user or assistant", "messages")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestFieldError(f"{where}.content must be text or a list of blocks", "messages")
    texts, calls, results = [], [], []
    for block_index, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        block_where = f"{where}.content[{block_index}]"
        if kind == "text":
            texts.append(_block_text(where, block_index, block))
        elif kind == "tool_use" and role == "assistant":
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": arguments},
                }
            )
        elif kind == "tool_result" and role == "user":
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": block.get("tool_use_id"),
                    "content": _result_text(block_where, block),
                }
            )
        elif kind not in ("thinking", "redacted_thinking"):  # the model's own reasoning, sent back: dropped
            raise RequestFieldError(
                f"{block_where} is a {kind!r} block, which this server does not take", "messages"
            )
    if role == "assistant":
        reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        return [{**reply, "tool_calls": calls}] if calls else [reply]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _block_text(where: str, index: int, block: dict[str, Any]) -> str:
    if block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise RequestFieldError(f"{where}[{index}] must be a text block", "messages")
    return block["text"]


def _result_text(where: str, block: dict[str, Any]) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    return "".join(_block_text(f"{where}.content", i, part) for i, part in enumerate(content))


def _chat_tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    kind = tool.get("type", "custom")
    if kind != "custom":
        raise RequestFieldError(
            f"tools[{index}] has type {kind!r}: this server runs no server tools, only custom ones", "tools"
        )
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    fields: dict[str, Any] = {}
    if choice.get("disable_parallel_tool_use"):
        fields["parallel_tool_calls"] = False
    if kind in ("auto", "none"):
        return {**fields, "tool_choice": kind}
    if kind == "any":
        return {**fields, "tool_choice": "required"}
    if kind == "tool":
        return {**fields, "tool_choice": {"type": "function", "function": {"name": choice.get("name")}}}
    raise RequestFieldError(f"tool_choice has type {kind!r}: auto, any, tool or none", "tool_choice")
