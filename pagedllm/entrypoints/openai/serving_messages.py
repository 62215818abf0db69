"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

The request becomes a chat request (protocol_messages), which OpenAIServingChat prepares; the
output's deltas become content blocks (``thinking`` from the reasoning parser, ``text``,
``tool_use`` per call) and, streamed, Anthropic's events: message_start, then per block
content_block_start / content_block_delta (text_delta, thinking_delta, input_json_delta) /
content_block_stop, then message_delta (stop reason, usage) and message_stop.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pagedllm.entrypoints.openai.chat_output import ChatDelta
from pagedllm.entrypoints.openai.protocol_messages import (
    MessagesCountTokensRequest,
    MessagesRequest,
    chat_fields,
)
from pagedllm.entrypoints.openai.serving_engine import log_advisory_fields
from pagedllm.entrypoints.openai.serving_responses import build_chat_request
from pagedllm.entrypoints.openai.tool_parsers import ToolCallDelta
from pagedllm.entrypoints.openai.tools import extract_tool_calls

if TYPE_CHECKING:
    from starlette.requests import Request

    from pagedllm.engine.async_engine import RequestStream
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, PreparedChat
    from pagedllm.outputs import CompletionOutput, RequestOutput

Event = dict[str, Any]


class OpenAIServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def count_tokens(self, request: MessagesCountTokensRequest) -> dict[str, int]:
        self.chat.check_model(request.model)
        chat_request = build_chat_request(lambda: chat_fields(request))
        return {"input_tokens": len(await self.chat.render(chat_request))}

    async def create_message(
        self, request: MessagesRequest, raw_request: Request
    ) -> dict[str, Any] | AsyncIterator[str]:
        arrival_time = time.time()
        log_advisory_fields(request)
        chat_request = build_chat_request(lambda: chat_fields(request))
        prepared = await self.chat.prepare(chat_request)
        message_id = "msg_" + uuid.uuid4().hex[:24]
        [stream], guard = await self.chat.add_requests(
            message_id, [prepared.prompt], prepared.params, arrival_time, raw_request, bool(request.stream)
        )
        blocks = _Blocks(chat_request, prepared)
        if request.stream:
            return self._stream(message_id, blocks, stream, guard)
        with guard:
            [final] = await self.chat.collect([stream])
        blocks.feed_whole(final.outputs[0].text)
        blocks.close()
        return {
            **self._message(message_id, final),
            **blocks.stop(final.outputs[0]),
            "content": blocks.content,
        }

    def _message(self, message_id: str, final: RequestOutput) -> dict[str, Any]:
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": self.chat.model_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": len(final.prompt_token_ids),
                "output_tokens": sum(len(o.token_ids) for o in final.outputs),
            },
        }

    async def _stream(
        self, message_id: str, blocks: _Blocks, stream: RequestStream, guard: Any
    ) -> AsyncIterator[str]:
        final = None
        num_output_tokens = 0
        with guard:
            try:
                async for output in stream:
                    if final is None:
                        yield _event({"type": "message_start", "message": self._message(message_id, output)})
                    final = output
                    for delta in output.outputs:
                        num_output_tokens += len(delta.token_ids)
                        for event in blocks.feed(delta.text, finished=delta.finish_reason is not None):
                            yield _event(event)
            except Exception as e:
                yield _event({"type": "error", "error": {"type": "api_error", "message": str(e)}})
                return
        if final is None:
            return
        for event in blocks.close():
            yield _event(event)
        usage = {"output_tokens": num_output_tokens}
        yield _event({"type": "message_delta", "delta": blocks.stop(final.outputs[0]), "usage": usage})
        yield _event({"type": "message_stop"})


class _Blocks:
    """A reply's content blocks, built from its chat deltas; one block is open at a time."""

    def __init__(self, chat_request: Any, prepared: PreparedChat) -> None:
        self.chat_request = chat_request
        self.mode = prepared.mode
        self.parser = prepared.output_parsers() if prepared.output_parsers else None
        self.content: list[dict[str, Any]] = []
        self._open: int | None = None
        self._calls: dict[int, int] = {}  # tool call index -> block index
        # The output so far (constrained JSON is read whole).
        self._output_text = ""

    def feed(self, delta_text: str, finished: bool) -> list[Event]:
        """Events for the output's next text."""
        self._output_text += delta_text
        if self.mode in ("required", "named"):  # constrained JSON, read whole at the end
            return self._delta(self._constrained(self._output_text)) if finished else []
        if self.parser is None:
            return self._delta(ChatDelta(content=delta_text))
        return self._delta(self.parser.feed(delta_text, finished))

    def feed_whole(self, text: str) -> None:
        """A finished output that was not streamed: a malformed call is all text here."""
        if self.parser is None or self.mode in ("required", "named"):
            self.feed(text, finished=True)
            return
        reasoning, content, calls = self.parser.parse_whole(text)
        self._delta(
            ChatDelta(reasoning or "", content or "", _deltas([(c.name, c.arguments) for c in calls]))
        )

    def close(self) -> list[Event]:
        return self._close()

    def stop(self, completion: CompletionOutput) -> dict[str, Any]:
        """The message's stop_reason and stop_sequence."""
        if completion.finish_reason == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if self._calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if isinstance(completion.stop_reason, str):
            return {"stop_reason": "stop_sequence", "stop_sequence": completion.stop_reason}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def _constrained(self, text: str) -> ChatDelta:
        content, calls = extract_tool_calls(self.chat_request, self.mode, text)
        return ChatDelta(
            content=content or "",
            tool_calls=_deltas([(c.function.name, c.function.arguments) for c in calls]),
        )

    def _delta(self, delta: ChatDelta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            events += self._text("thinking", delta.reasoning)
        if delta.content:
            events += self._text("text", delta.content)
        for call in delta.tool_calls:
            if call.id is not None:
                events += self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
                self._calls[call.index] = self._open
                self.content[self._open]["partial_json"] = ""
            if call.arguments:
                index = self._calls[call.index]
                self.content[index]["partial_json"] += call.arguments
                delta_json = {"type": "input_json_delta", "partial_json": call.arguments}
                events.append({"type": "content_block_delta", "index": index, "delta": delta_json})
        return events

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self.content[self._open]["type"] != kind:
            block = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            events += self._start(block)
        self.content[self._open][kind] += text
        delta = (
            {"type": "thinking_delta", "thinking": text}
            if kind == "thinking"
            else {"type": "text_delta", "text": text}
        )
        return [*events, {"type": "content_block_delta", "index": self._open, "delta": delta}]

    def _start(self, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self.content.append(block)
        self._open = len(self.content) - 1
        return [*events, {"type": "content_block_start", "index": self._open, "content_block": dict(block)}]

    def _close(self) -> list[Event]:
        index, self._open = self._open, None
        if index is None:
            return []
        block = self.content[index]
        if block["type"] == "tool_use":
            block["input"] = _arguments_object(block.pop("partial_json"))
        return [{"type": "content_block_stop", "index": index}]


def _deltas(calls: list[tuple[str, str]]) -> list[ToolCallDelta]:
    """A whole output's calls as the deltas a stream would have sent."""
    deltas = []
    for index, (name, arguments) in enumerate(calls):
        deltas += [
            ToolCallDelta(index, _tool_use_id(), name, ""),
            ToolCallDelta(index, None, None, arguments),
        ]
    return deltas


def _tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def _arguments_object(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _event(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
