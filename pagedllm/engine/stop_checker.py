"""Decides, after each new token, whether a sequence is finished and why."""

from __future__ import annotations

from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceStatus


class StopChecker:
    """EOS, stop tokens, stop strings (matched across token boundaries), max_tokens, context length."""

    def __init__(self, max_model_len: int, eos_token_ids: set[int]) -> None:
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids

    def check(self, seq: Sequence, new_char_count: int, params: SamplingParams) -> None:
        """Set ``seq.status`` (and ``stop_reason``) when its newest token ends it.

        ``new_char_count`` is how many characters the newest token added to ``seq.output_text``.
        """
        if seq.num_output_tokens >= params.min_tokens and self._check_stop(seq, new_char_count, params):
            return
        if seq.get_len() >= self.max_model_len or (
            params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens
        ):
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

    def _check_stop(self, seq: Sequence, new_char_count: int, params: SamplingParams) -> bool:
        last_token_id = seq.get_last_token_id()
        is_eos = not params.ignore_eos and last_token_id in self.eos_token_ids
        if is_eos or last_token_id in params.stop_token_ids:
            # The stop token's own text (when special tokens are kept) is not part of the answer.
            if new_char_count and not params.include_stop_str_in_output:
                seq.output_text = seq.output_text[:-new_char_count]
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = None if is_eos else last_token_id
            return True
        stop = self._find_stop_string(seq, new_char_count, params)
        if stop is None:
            return False
        stop_str, index = stop
        end = index + len(stop_str) if params.include_stop_str_in_output else index
        seq.output_text = seq.output_text[:end]
        seq.status = SequenceStatus.FINISHED_STOPPED
        seq.stop_reason = stop_str
        return True

    @staticmethod
    def _find_stop_string(
        seq: Sequence, new_char_count: int, params: SamplingParams
    ) -> tuple[str, int] | None:
        """The earliest stop string that the newest characters complete, and where it starts."""
        if not params.stop or not new_char_count:
            return None
        text = seq.output_text
        best: tuple[str, int] | None = None
        for stop_str in params.stop:
            # Only a match that ends in the new characters is new; it may start before them.
            start = max(len(text) - new_char_count - len(stop_str) + 1, 0)
            index = text.find(stop_str, start)
            if index != -1 and (best is None or index < best[1]):
                best = (stop_str, index)
        return best
