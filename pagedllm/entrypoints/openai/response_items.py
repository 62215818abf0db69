"""A chat output's deltas -> the Responses API's output items and its stream events.

Items open and close as the output moves between reasoning, text and function calls: a
``reasoning`` item for the reasoning parser's text, a ``message`` item with one ``output_text``
part for the answer, a ``function_call`` item per call (its arguments stream as deltas). The same
builder serves a streamed response (the events) and a whole one (the items), so both agree.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from pagedllm.entrypoints.openai.chat_output import ChatDelta

Event = dict[str, Any]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class OutputItems:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        # The reasoning or message item text goes to (None: the next text opens one).
        self._open_text: int | None = None
        # A tool call's index among the output's calls -> its item's index.
        self._calls: dict[int, int] = {}

    def feed(self, delta: ChatDelta) -> list[Event]:
        """The events that ``delta`` makes (the items change alongside)."""
        events: list[Event] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls:
            if call.id is not None:
                events += self._close_text()
                item = {
                    "type": "function_call",
                    "id": _new_id("fc"),
                    "call_id": call.id,
                    "name": call.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                self._calls[call.index] = len(self.items)
                events.append(self._add(item))
            if call.arguments:
                index = self._calls[call.index]
                self.items[index]["arguments"] += call.arguments
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": self.items[index]["id"],
                        "output_index": index,
                        "delta": call.arguments,
                    }
                )
        return events

    def close(self, status: str = "completed") -> list[Event]:
        """Close every open item (``status``: completed, or incomplete when the output was cut)."""
        events = self._close_text(status)
        for index in self._calls.values():
            item = self.items[index]
            done = {"item_id": item["id"], "output_index": index, "name": item["name"]}
            events.append(
                {"type": "response.function_call_arguments.done", **done, "arguments": item["arguments"]}
            )
            events.append(self._done(index, status))
        self._calls = {}
        return events

    # --- steps ------------------------------------------------------------------------------

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open_text is None or self.items[self._open_text]["type"] != kind:
            events += self._close_text()
            events += self._open(kind)
        index = self._open_text
        item = self.items[index]
        item["content"][0]["text"] += text
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if kind == "reasoning":
            events.append({"type": "response.reasoning_text.delta", **where, "delta": text})
        else:
            events.append({"type": "response.output_text.delta", **where, "delta": text, "logprobs": []})
        return events

    def _open(self, kind: str) -> list[Event]:
        self._open_text = len(self.items)
        if kind == "reasoning":
            item = {
                "type": "reasoning",
                "id": _new_id("rs"),
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            part = {"type": "reasoning_text", "text": ""}
            added = self._add(item)
            item["content"].append(part)
            return [added]
        item = {
            "type": "message",
            "id": _new_id("msg"),
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        added = self._add(item)
        item["content"].append(part)
        where = {"item_id": item["id"], "output_index": self._open_text, "content_index": 0}
        return [added, {"type": "response.content_part.added", **where, "part": copy.deepcopy(part)}]

    def _close_text(self, status: str = "completed") -> list[Event]:
        index, self._open_text = self._open_text, None
        if index is None:
            return []
        item = self.items[index]
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            events = [{"type": "response.reasoning_text.done", **where, "text": part["text"]}]
        else:
            events = [
                {"type": "response.output_text.done", **where, "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", **where, "part": copy.deepcopy(part)},
            ]
        return [*events, self._done(index, status)]

    def _add(self, item: dict[str, Any]) -> Event:
        self.items.append(item)
        return {
            "type": "response.output_item.added",
            "output_index": len(self.items) - 1,
            "item": copy.deepcopy(item),
        }

    def _done(self, index: int, status: str) -> Event:
        self.items[index]["status"] = status
        return {
            "type": "response.output_item.done",
            "output_index": index,
            "item": copy.deepcopy(self.items[index]),
        }


def assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output as one chat message, for the stored conversation (reasoning left out, as chat
    templates leave it out of the history)."""
    text = "".join(item["content"][0]["text"] for item in items if item["type"] == "message")
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in items
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message
