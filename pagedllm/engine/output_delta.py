"""RequestOutputs across a process boundary, as deltas.

A running request's RequestOutput is cumulative: its text, token ids and logprobs so far. Pickled
whole after every step, a stream of n tokens would cost O(n^2) bytes and pickling time in the
engine process, the one that must stay fast. The encoder sends a request's first output whole
and then, per sequence, only what was appended since the output it sent last; the decoder, in the
frontend, rebuilds the cumulative output (new lists each time: the consumer may hold the old).

A sequence whose tokens or text did not just grow (beam search replacing a beam, best_of ranking
its sequences at the end) is sent whole, so the rebuilt outputs always equal the engine's.
Both sides forget a request at its finished output or when the engine reports it aborted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedllm.outputs import CompletionOutput, RequestOutput

# Per sequence: (new token ids, new text, new logprobs or None, cumulative_logprob,
# finish_reason, stop_reason).
_SeqDelta = tuple[list[int], str, list | None, float | None, str | None, int | str | None]


class OutputDeltaEncoder:
    """Engine side: RequestOutputs -> their encodings, each a RequestOutput (whole) or a tuple
    (request_id, sequence deltas, new prompt logprobs, finished, metrics at the end, error)."""

    def __init__(self) -> None:
        self._sent: dict[str, RequestOutput] = {}

    def encode(self, outputs: list[RequestOutput], aborted: Iterable[str] = ()) -> list[Any]:
        for request_id in aborted:
            self._sent.pop(request_id, None)
        encoded: list[Any] = []
        for output in outputs:
            previous = self._sent.pop(output.request_id, None)
            if not output.finished:
                self._sent[output.request_id] = output
            deltas = None if previous is None else _seq_deltas(previous.outputs, output.outputs)
            if deltas is None:
                encoded.append(output)
                continue
            prompt_logprobs = None
            if output.prompt_logprobs is not None:
                prompt_logprobs = output.prompt_logprobs[len(previous.prompt_logprobs or ()) :]
            metrics = output.metrics if output.finished else None
            encoded.append(
                (output.request_id, deltas, prompt_logprobs, output.finished, metrics, output.error)
            )
        return encoded

    def __len__(self) -> int:
        return len(self._sent)


class OutputDeltaDecoder:
    """Frontend side: encodings -> the RequestOutputs the engine emitted."""

    def __init__(self) -> None:
        self._outputs: dict[str, RequestOutput] = {}

    def decode(self, encoded: list[Any], aborted: Iterable[str] = ()) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for item in encoded:
            if isinstance(item, RequestOutput):
                output = item
            else:
                output = self._apply(*item)
            if output.finished:
                self._outputs.pop(output.request_id, None)
            else:
                self._outputs[output.request_id] = output
            outputs.append(output)
        for request_id in aborted:
            self._outputs.pop(request_id, None)
        return outputs

    def __len__(self) -> int:
        return len(self._outputs)

    def _apply(
        self,
        request_id: str,
        deltas: list[_SeqDelta],
        prompt_logprobs: list | None,
        finished: bool,
        metrics: Any,
        error: str | None,
    ) -> RequestOutput:
        previous = self._outputs[request_id]
        seqs = []
        for seq, (token_ids, text, logprobs, cumulative_logprob, finish_reason, stop_reason) in zip(
            previous.outputs, deltas
        ):
            seqs.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.text + text,
                    token_ids=seq.token_ids + token_ids,
                    cumulative_logprob=cumulative_logprob,
                    logprobs=None if logprobs is None else (seq.logprobs or []) + logprobs,
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                )
            )
        if prompt_logprobs is not None:
            prompt_logprobs = (previous.prompt_logprobs or []) + prompt_logprobs
        return RequestOutput(
            request_id=request_id,
            prompt=previous.prompt,
            prompt_token_ids=previous.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=seqs,
            finished=finished,
            metrics=metrics if metrics is not None else previous.metrics,
            error=error,
        )


def _seq_deltas(previous: list[CompletionOutput], current: list[CompletionOutput]) -> list[_SeqDelta] | None:
    """What each sequence appended since ``previous``; None when one did not just append."""
    if len(previous) != len(current):
        return None
    deltas: list[_SeqDelta] = []
    for old, new in zip(previous, current):
        num_tokens = len(old.token_ids)
        if (
            old.index != new.index
            or new.token_ids[:num_tokens] != old.token_ids
            or not new.text.startswith(old.text)
            or (old.logprobs is None) != (new.logprobs is None)
        ):
            return None
        logprobs = None if new.logprobs is None else new.logprobs[len(old.logprobs) :]
        deltas.append(
            (
                new.token_ids[num_tokens:],
                new.text[len(old.text) :],
                logprobs,
                new.cumulative_logprob,
                new.finish_reason,
                new.stop_reason,
            )
        )
    return deltas
