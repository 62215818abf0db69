"""The reasoning parsers on literal outputs, whole and streamed in arbitrary deltas."""

from __future__ import annotations

import itertools
import random

import pytest

from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningDelta

# (parser, output, reasoning, content)
CASES = [
    ("qwen3", "<think>\nThe user greets.\n</think>\n\nHello!", "\nThe user greets.\n", "Hello!"),
    ("qwen3", "\n<think>a < b</think>x</thinking>", "a < b", "x</thinking>"),
    ("qwen3", "Hello without thinking.", "", "Hello without thinking."),
    ("qwen3", "<think>cut off by max_tokens", "cut off by max_tokens", ""),
    ("qwen3", "<thin", "", "<thin"),
    ("deepseek_r1", "The prompt opened it.\n</think>\n\n42", "The prompt opened it.\n", "42"),
    ("deepseek_r1", "<think>written anyway</think>42", "written anyway", "42"),
    ("deepseek_r1", "never closed </thi", "never closed </thi", ""),
    ("deepseek_r1", "</think>", "", ""),
]


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_whole_and_streamed_in_any_pieces(name, text, reasoning, content):
    whole = REASONING_PARSERS[name]().parse(text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    rng = random.Random(len(text))
    splits = [list(range(1, len(text)))] + [
        sorted(rng.sample(range(1, len(text)), min(k, len(text) - 1))) for k in (1, 2, 5) for _ in range(4)
    ]
    for cuts in splits:
        parser = REASONING_PARSERS[name]()
        bounds = [0, *cuts, len(text)]
        streamed = [parser.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
        total = sum(streamed, start=ReasoningDelta()) + parser.finish()
        assert (total.reasoning, total.content) == (reasoning, content), cuts


def test_reasoning_streams_before_the_tag_closes():
    parser = REASONING_PARSERS["qwen3"]()
    assert parser.feed("<think>Let me").reasoning == "Let me"
    assert parser.feed(" think </th").reasoning == " think "  # "</th" may be the closing tag
    delta = parser.feed("ink>Answer")
    assert (delta.reasoning, delta.content) == ("", "Answer")
