"""ChoiceDeltas: what each cumulative output adds to each choice, choices interleaved."""

from __future__ import annotations

from pagedllm.entrypoints.openai.choice_deltas import ChoiceDelta, ChoiceDeltas
from pagedllm.outputs import CompletionOutput, RequestOutput


def _output(*choices: tuple[int, str, list[int], str | None]) -> RequestOutput:
    outputs = [CompletionOutput(i, text, ids, None, None, finish) for i, text, ids, finish in choices]
    return RequestOutput("r", None, [1], None, outputs, finished=False)


def test_each_output_gives_what_each_choice_gained():
    deltas = ChoiceDeltas()
    assert deltas.of(_output((0, "He", [5], None), (1, "", [], None))) == [ChoiceDelta(0, "He", [5], None)]
    # A token that adds no text yet (half a character) is still a delta; an unchanged choice is not.
    assert deltas.of(_output((0, "He", [5, 6], None), (1, "Yo", [7], None))) == [
        ChoiceDelta(0, "", [6], None),
        ChoiceDelta(1, "Yo", [7], None),
    ]
    assert deltas.of(_output((0, "Hey", [5, 6, 8], "stop"), (1, "Yo", [7], None))) == [
        ChoiceDelta(0, "y", [8], "stop")
    ]
