"""Decides, after each new token, whether a sequence is finished and why."""

from __future__ import annotations

from pagedllm.core.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams


class StopChecker:
    """EOS, stop tokens, stop strings (matched across token boundaries), max_tokens, context length."""

    def __init__(self, max_model_len: int | None, eos_token_ids: set[int]) -> None:
        """max_model_len: the context limit (None: none, with attention sinks)."""
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids

    def check(self, seq: Request, new_char_count: int, params: SamplingParams) -> RequestStatus | None:
        """The status the request's newest token ends it with (setting its ``stop_reason`` and
        trimming its text), or None.

        ``new_char_count`` is how many characters the newest token added to ``seq.output_text``.
        Runs for every sampled token: written flat, without helper calls.
        """
        output_token_ids = seq.output_token_ids
        num_output_tokens = len(output_token_ids)
        if output_token_ids and num_output_tokens >= params.min_tokens:
            token_id = output_token_ids[-1]
            is_eos = not params.ignore_eos and token_id in self.eos_token_ids
            if is_eos or token_id in params.stop_token_ids:
                # The stop token's own text (when special tokens are kept) is not part of the answer.
                if new_char_count and not params.include_stop_str_in_output:
                    seq.output_text = seq.output_text[:-new_char_count]
                seq.stop_reason = None if is_eos else token_id
                return RequestStatus.FINISHED_STOPPED
            stop = self._find_stop_string(seq, new_char_count, params) if params.stop else None
            if stop is not None:
                stop_str, index = stop
                end = index + len(stop_str) if params.include_stop_str_in_output else index
                seq.output_text = seq.output_text[:end]
                seq.stop_reason = stop_str
                return RequestStatus.FINISHED_STOPPED
        if self._at_length_limit(len(seq.prompt_token_ids) + num_output_tokens, num_output_tokens, params):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def status_if_appended(self, seq: Request, token_id: int, params: SamplingParams) -> RequestStatus | None:
        """How the sequence would finish if ``token_id`` came next, by token and length alone (beam
        search weighs candidates before any is appended; it takes no stop strings)."""
        num_output_tokens = seq.num_output_tokens + 1
        if self._stops_on_token(token_id, num_output_tokens, params):
            return RequestStatus.FINISHED_STOPPED
        if self._at_length_limit(seq.num_tokens + 1, num_output_tokens, params):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _eos(self, params: SamplingParams) -> set[int]:
        return set() if params.ignore_eos else self.eos_token_ids

    def _stops_on_token(self, token_id: int, num_output_tokens: int, params: SamplingParams) -> bool:
        if num_output_tokens < params.min_tokens:
            return False
        return token_id in self._eos(params) or token_id in params.stop_token_ids

    def _at_length_limit(self, seq_len: int, num_output_tokens: int, params: SamplingParams) -> bool:
        if self.max_model_len is not None and seq_len >= self.max_model_len:
            return True
        return params.max_tokens is not None and num_output_tokens >= params.max_tokens

    @staticmethod
    def _find_stop_string(
        seq: Request, new_char_count: int, params: SamplingParams
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
