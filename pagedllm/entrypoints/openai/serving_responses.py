"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat path.

The request becomes a chat request (protocol_responses), which OpenAIServingChat prepares
(template, tools, reasoning, structured outputs); the output's deltas become output items and
Responses stream events (response_items). With ``store`` (OpenAI's default) a response and its
conversation are kept in memory, the newest MAX_STORED_RESPONSES of them (vLLM keeps them in
memory too), for ``previous_response_id`` and GET.
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from pagedllm.entrypoints.openai.chat_output import ChatDelta, ChatOutputParser
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.protocol_responses import (
    RequestFieldError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    chat_fields,
    input_messages,
)
from pagedllm.entrypoints.openai.response_items import OutputItems, assistant_message
from pagedllm.entrypoints.openai.serving_engine import APIError, log_advisory_fields
from pagedllm.entrypoints.openai.tool_parsers import ToolCallDelta
from pagedllm.entrypoints.openai.tool_parsers.streaming import new_tool_call_id
from pagedllm.entrypoints.openai.tools import extract_tool_calls

if TYPE_CHECKING:
    from starlette.requests import Request

    from pagedllm.engine.async_engine import RequestStream
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, PreparedChat
    from pagedllm.outputs import RequestOutput

# Stored responses kept (the oldest go first): a bound on the memory a client can make us hold.
MAX_STORED_RESPONSES = 1024


@dataclass
class _Stored:
    response: ResponseObject
    # The conversation up to and including this response's output, as chat messages (without
    # instructions, which apply to one response only).
    messages: list[dict[str, Any]]


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self._stored: collections.OrderedDict[str, _Stored] = collections.OrderedDict()

    def retrieve(self, response_id: str) -> ResponseObject:
        stored = self._stored.get(response_id)
        if stored is None:
            raise APIError(
                404, f"no stored response has id {response_id!r}", param="response_id", code="not_found"
            )
        return stored.response

    async def create_response(
        self, request: ResponsesRequest, raw_request: Request
    ) -> ResponseObject | AsyncIterator[str]:
        arrival_time = time.time()
        log_advisory_fields(request)
        history = self._history(request.previous_response_id)
        chat_request = build_chat_request(lambda: chat_fields(request, history))
        prepared = await self.chat.prepare(chat_request)
        if prepared.params.n != 1:
            raise APIError(400, "a response has one output", param="n")
        # Ids of stored responses are the server's own: a client's X-Request-Id may repeat.
        response_id = "resp_" + uuid.uuid4().hex
        response = ResponseObject.start(request, response_id, int(arrival_time), self.chat.model_name)
        [stream], guard = await self.chat.add_requests(
            response_id, [prepared.prompt], prepared.params, arrival_time, raw_request, bool(request.stream)
        )
        run = _Run(chat_request, prepared, response, [*history, *input_messages(request.input)])
        if request.stream:
            return self._stream(run, stream, guard, request.store is not False)
        with guard:
            [final] = await self.chat.collect([stream])
        run.feed_whole(final.outputs[0].text)
        run.finish(final)
        if request.store is not False:
            self._store(run)
        return run.response

    def _history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        if previous_response_id is None:
            return []
        stored = self._stored.get(previous_response_id)
        if stored is None:
            raise APIError(
                404,
                f"previous_response_id {previous_response_id!r} is no stored response (it was not stored, "
                f"or is older than the newest {MAX_STORED_RESPONSES})",
                param="previous_response_id",
                code="not_found",
            )
        return stored.messages

    def _store(self, run: _Run) -> None:
        messages = [*run.conversation, assistant_message(run.items.items)]
        self._stored[run.response.id] = _Stored(run.response, messages)
        while len(self._stored) > MAX_STORED_RESPONSES:
            self._stored.popitem(last=False)

    async def _stream(self, run: _Run, stream: RequestStream, guard: Any, store: bool) -> AsyncIterator[str]:
        events = _EventWriter()
        yield events.write({"type": "response.created", "response": run.response.model_dump()})
        yield events.write({"type": "response.in_progress", "response": run.response.model_dump()})
        final = None
        with guard:
            try:
                async for output in stream:
                    final = output
                    for delta in output.outputs:
                        run.num_output_tokens += len(delta.token_ids)
                        for event in run.feed(delta.text, finished=delta.finish_reason is not None):
                            yield events.write(event)
            except Exception as e:
                yield events.write(
                    {"type": "error", "code": "server_error", "message": str(e), "param": None}
                )
                return
        if final is None:
            return
        for event in run.finish(final):
            yield events.write(event)
        if store:
            self._store(run)
        kind = "response.completed" if run.response.status == "completed" else "response.incomplete"
        yield events.write({"type": kind, "response": run.response.model_dump()})


class _Run:
    """One response in progress: its output read as it grows, into items and events."""

    def __init__(
        self,
        chat_request: ChatCompletionRequest,
        prepared: PreparedChat,
        response: ResponseObject,
        conversation: list[dict[str, Any]],
    ) -> None:
        self.chat_request = chat_request
        self.mode = prepared.mode
        self.parser: ChatOutputParser | None = prepared.output_parsers() if prepared.output_parsers else None
        self.response = response
        self.conversation = conversation
        self.items = OutputItems()
        # The output so far (constrained JSON is read whole), and its tokens when streamed.
        self._output_text = ""
        self.num_output_tokens = 0

    def feed(self, delta_text: str, finished: bool) -> list[dict[str, Any]]:
        """Events for the output's next text."""
        self._output_text += delta_text
        if self.mode in ("required", "named"):
            # Constrained JSON: the calls are read whole when the output ends.
            if not finished:
                return []
            content, calls = extract_tool_calls(self.chat_request, self.mode, self._output_text)
            deltas = [
                d
                for i, c in enumerate(calls)
                for d in _call_deltas(i, c.id, c.function.name, c.function.arguments)
            ]
            return self.items.feed(ChatDelta(content=content or "", tool_calls=deltas))
        if self.parser is None:
            return self.items.feed(ChatDelta(content=delta_text))
        return self.items.feed(self.parser.feed(delta_text, finished))

    def feed_whole(self, text: str) -> None:
        """A finished output that was not streamed: a malformed call is all text here."""
        if self.parser is None or self.mode in ("required", "named"):
            self.feed(text, finished=True)
            return
        reasoning, content, calls = self.parser.parse_whole(text)
        deltas = [
            d for i, c in enumerate(calls) for d in _call_deltas(i, new_tool_call_id(), c.name, c.arguments)
        ]
        self.items.feed(ChatDelta(reasoning or "", content or "", deltas))

    def finish(self, final: RequestOutput) -> list[dict[str, Any]]:
        """Close the items; the response gets its output, status and usage."""
        completion = final.outputs[0]
        cut = completion.finish_reason == "length"
        events = self.items.close("incomplete" if cut else "completed")
        response = self.response
        response.output = self.items.items
        response.status = "incomplete" if cut else "completed"
        if cut:
            response.incomplete_details = {"reason": "max_output_tokens"}
        if completion.finish_reason in ("abort", "error"):
            response.status, response.error = (
                "failed",
                {"code": "server_error", "message": final.error or "aborted"},
            )
        num_input, num_output = (
            len(final.prompt_token_ids),
            self.num_output_tokens or len(completion.token_ids),
        )
        response.usage = ResponseUsage(
            input_tokens=num_input, output_tokens=num_output, total_tokens=num_input + num_output
        )
        return events


def _call_deltas(index: int, call_id: str, name: str, arguments: str) -> list[ToolCallDelta]:
    return [ToolCallDelta(index, call_id, name, ""), ToolCallDelta(index, None, None, arguments)]


class _EventWriter:
    """Server-sent events as OpenAI sends them: ``event: <type>`` and the data, numbered."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def write(self, event: dict[str, Any]) -> str:
        event = {**event, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def build_chat_request(make_fields: Callable[[], dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that ``make_fields`` describes; what it cannot take is a 400 naming the
    field (also /v1/messages')."""
    try:
        return ChatCompletionRequest.model_validate(make_fields())
    except RequestFieldError as e:
        raise APIError(400, str(e), param=e.param) from e
    except ValidationError as e:
        first = e.errors()[0]
        path = ".".join(str(part) for part in first["loc"])
        raise APIError(400, f"{path}: {first['msg']}", param=path.split(".")[0] or None) from e
