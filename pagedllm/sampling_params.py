"""Sampling parameters for text generation, with vLLM's field names and semantics."""

from __future__ import annotations

import enum
from dataclasses import dataclass

# Temperatures below this are greedy: dividing logits by them would overflow.
_GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2
    BEAM = 3


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class SamplingParams:
    """How to sample one request's output sequences.

    Args:
        n: number of output sequences returned for the prompt.
        best_of: number of sequences generated, of which the ``n`` with the highest cumulative
            logprob are returned (the beam width with beam search). Defaults to ``n``.
        presence_penalty: in [-2, 2]; penalises tokens that already appeared in the output
            (OpenAI semantics: subtracted once from the logit of every token seen).
        frequency_penalty: in [-2, 2]; penalises tokens by how often they appeared in the output.
        repetition_penalty: > 0; HF semantics over prompt and output tokens (1 = off).
        temperature: >= 0; 0 means greedy.
        top_p: in (0, 1]; nucleus sampling.
        top_k: -1 or 0 for all tokens, else the number of most likely tokens kept.
        min_p: in [0, 1]; drop tokens whose probability is below ``min_p`` times the largest.
        seed: seeds this request's own generator: the same seed gives the same output whatever
            else shares the batch.
        use_beam_search, length_penalty, early_stopping: beam search as in HF ``generate``.
        stop: strings that end generation; they are not included in the output text.
        stop_token_ids: tokens that end generation (kept in the token ids, not in the text).
        ignore_eos: keep generating after the EOS token.
        max_tokens: most tokens to generate; None means up to the model's context length.
        min_tokens: tokens generated before EOS or ``stop_token_ids`` may end the output.
        logprobs: number of most likely tokens whose logprobs are returned for each output token
            (plus the chosen one), up to 20.
        prompt_logprobs: the same for each prompt token.
        skip_special_tokens: drop special tokens from the output text.
        spaces_between_special_tokens: put spaces between special tokens in the output text.
        include_stop_str_in_output: keep the matched stop string in the text.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if self.temperature < _GREEDY_TEMPERATURE and not self.use_beam_search:
            # Greedy ignores these; normalising them keeps the sampler's fast path simple.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0
        self._verify_args()
        if self.use_beam_search:
            self._verify_beam_search()
        else:
            self._verify_non_beam_search()
            if self.temperature < _GREEDY_TEMPERATURE:
                self._verify_greedy()

    def _verify_args(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1", self.n)
        _check(
            isinstance(self.best_of, int) and self.best_of >= self.n,
            "best_of",
            f"an integer >= n ({self.n})",
            self.best_of,
        )
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _check(
            -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]", self.frequency_penalty
        )
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "> 0", self.repetition_penalty)
        _check(self.temperature >= 0.0, "temperature", ">= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
            "top_k",
            "-1 or 0 (all tokens) or an integer >= 1",
            self.top_k,
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        _check(self.seed is None or isinstance(self.seed, int), "seed", "None or an integer", self.seed)
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            "None or an integer >= 1",
            self.max_tokens,
        )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", ">= 0", self.min_tokens
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"<= max_tokens ({self.max_tokens})",
                self.min_tokens,
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS),
                name,
                f"None or an integer in [0, {MAX_LOGPROBS}]",
                value,
            )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "non-negative integers",
            self.stop_token_ids,
        )

    def _verify_beam_search(self) -> None:
        _check(self.best_of > 1, "best_of", "> 1 with beam search (it is the beam width)", self.best_of)
        _check(self.temperature < _GREEDY_TEMPERATURE, "temperature", "0 with beam search", self.temperature)
        _check(self.top_p == 1.0, "top_p", "1 with beam search", self.top_p)
        _check(self.top_k == -1, "top_k", "-1 with beam search", self.top_k)
        _check(self.min_p == 0.0, "min_p", "0 with beam search", self.min_p)
        _check(
            self.early_stopping in (True, False, "never"),
            "early_stopping",
            "True, False or 'never'",
            self.early_stopping,
        )
        _check(
            not self.stop,
            "stop",
            "empty with beam search (beams end on EOS, stop_token_ids or length)",
            self.stop,
        )

    def _verify_non_beam_search(self) -> None:
        _check(
            self.early_stopping is False,
            "early_stopping",
            "False without beam search",
            self.early_stopping,
        )
        _check(
            self.length_penalty == 1.0,
            "length_penalty",
            "1.0 without beam search",
            self.length_penalty,
        )

    def _verify_greedy(self) -> None:
        _check(
            self.best_of == 1,
            "best_of",
            "1 with greedy sampling (temperature 0); raise the temperature for several samples",
            self.best_of,
        )

    @property
    def sampling_type(self) -> SamplingType:
        if self.use_beam_search:
            return SamplingType.BEAM
        if self.temperature < _GREEDY_TEMPERATURE:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    @property
    def max_stop_string_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
