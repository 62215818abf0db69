"""Stop strings: the stop condition that needs text, checked after each new token's text.

EOS, stop token ids, ``max_tokens`` and the context limit are the core's: the scheduler ends a
request on them as it appends the token (``core/stop_conditions.py``). What is left here needs
the text: stop strings (matched across token boundaries), and cutting a stop token's own text
from the answer.
"""

from __future__ import annotations

from typing import Protocol

from pagedllm.sampling_params import SamplingParams


class StoppableSequence(Protocol):
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None


def check_stop_strings(seq: StoppableSequence, new_char_count: int, params: SamplingParams) -> bool:
    """Whether the newest characters complete a stop string (then the sequence's ``stop_reason``
    is set and its text cut there).

    ``new_char_count`` is how many characters the newest tokens added to ``seq.text``. A sequence
    the core stopped on this token (EOS or a stop token id: finish reason "stop") loses that
    token's text instead, unless ``include_stop_str_in_output``. Runs for every sampled token.
    """
    if seq.finish_reason == "stop":
        if new_char_count and not params.include_stop_str_in_output:
            seq.text = seq.text[:-new_char_count]
        return False
    if not params.stop or not new_char_count or len(seq.token_ids) < params.min_tokens:
        return False
    text = seq.text
    best: tuple[str, int] | None = None
    for stop_str in params.stop:
        # Only a match that ends in the new characters is new; it may start before them.
        start = max(len(text) - new_char_count - len(stop_str) + 1, 0)
        index = text.find(stop_str, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop_str, index)
    if best is None:
        return False
    stop_str, index = best
    seq.text = text[: index + len(stop_str) if params.include_stop_str_in_output else index]
    seq.stop_reason = stop_str
    return True
