"""What each output of a streamed request adds to each of its choices: the one place the new
routes (/v1/responses, /v1/messages) read an engine stream through.

Here an engine output is cumulative (a choice's whole text and tokens so far), so this diffs it.
With outputs that carry only what is new (vLLM's ``RequestOutputKind.DELTA``), ``ChoiceDeltas.of``
passes a CompletionOutput's text and token ids through instead; nothing else changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.outputs import RequestOutput


@dataclass
class ChoiceDelta:
    index: int
    # The text and token ids the choice gained.
    text: str
    token_ids: list[int]
    # Set on the choice's last delta.
    finish_reason: str | None


class ChoiceDeltas:
    """Feed a request's outputs in order; each gives the deltas of the choices it changed."""

    def __init__(self) -> None:
        # Per choice: characters and tokens already handed out.
        self._num_seen: dict[int, tuple[int, int]] = {}

    def of(self, output: RequestOutput) -> list[ChoiceDelta]:
        deltas = []
        for completion in output.outputs:
            num_chars, num_tokens = self._num_seen.get(completion.index, (0, 0))
            text, token_ids = completion.text[num_chars:], completion.token_ids[num_tokens:]
            if not (text or token_ids or completion.finish_reason):
                continue
            self._num_seen[completion.index] = (len(completion.text), len(completion.token_ids))
            deltas.append(ChoiceDelta(completion.index, text, list(token_ids), completion.finish_reason))
        return deltas
