"""Reasoning between ``<think>`` and ``</think>``, as Qwen3 and DeepSeek-R1 write it.

- ``qwen3``: reasoning only when the output opens with ``<think>`` (whitespace before it allowed);
  an output that does not is all answer (Qwen3 with ``enable_thinking=False``, whose template
  closes an empty think block in the prompt).
- ``deepseek_r1``: the output starts inside the reasoning (R1's template, like Qwen3's thinking-only
  2507 models, opens ``<think>`` in the prompt); a leading ``<think>`` is dropped if the model
  writes it anyway. An output that never closes it is all reasoning.

Either way, the answer is what follows ``</think>``, without the whitespace the model puts right
after the tag. These are vLLM's ``qwen3`` and ``deepseek_r1`` parsers' rules.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning_parsers.base import ReasoningDelta, ReasoningParser
from pagedllm.entrypoints.openai.text_markers import held_prefix_len

START, END = "<think>", "</think>"


class _ThinkTagParser(ReasoningParser):
    # Whether an output that does not open with <think> is reasoning (else it is all answer).
    STARTS_IN_REASONING: bool

    def __init__(self) -> None:
        # "start": before the first visible text; "reasoning"; "answer_start": after </think>,
        # dropping whitespace; "answer".
        self._state = "start"
        self._held = ""

    def feed(self, delta_text: str) -> ReasoningDelta:
        text, self._held = self._held + delta_text, ""
        result = ReasoningDelta()
        while text:
            text = getattr(self, "_in_" + self._state)(text, result)
        return result

    def finish(self) -> ReasoningDelta:
        held, self._held = self._held, ""
        if not held:
            return ReasoningDelta()
        if self._state == "reasoning" or (self._state == "start" and self.STARTS_IN_REASONING):
            return ReasoningDelta(reasoning=held)
        return ReasoningDelta(content=held.lstrip() if self._state == "answer_start" else held)

    # Each step takes the text left, adds what it decides to ``result``, returns the rest.

    def _in_start(self, text: str, result: ReasoningDelta) -> str:
        stripped = text.lstrip()
        if stripped.startswith(START):
            self._state = "reasoning"
            return stripped[len(START) :]
        if START.startswith(stripped):  # still may become <think>
            self._held = text
            return ""
        self._state = "reasoning" if self.STARTS_IN_REASONING else "answer"
        return text

    def _in_reasoning(self, text: str, result: ReasoningDelta) -> str:
        end = text.find(END)
        if end >= 0:
            result.reasoning += text[:end]
            self._state = "answer_start"
            return text[end + len(END) :]
        keep = held_prefix_len(text, END)
        result.reasoning += text[: len(text) - keep]
        self._held = text[len(text) - keep :]
        return ""

    def _in_answer_start(self, text: str, result: ReasoningDelta) -> str:
        text = text.lstrip()
        if text:
            self._state = "answer"
        return text

    def _in_answer(self, text: str, result: ReasoningDelta) -> str:
        result.content += text
        return ""


class Qwen3ReasoningParser(_ThinkTagParser):
    STARTS_IN_REASONING = False


class DeepSeekR1ReasoningParser(_ThinkTagParser):
    STARTS_IN_REASONING = True
