"""Sampling parameters for text generation, with vLLM's field names and semantics."""

from __future__ import annotations

import enum
import json
import math
import numbers
import operator
import re
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are greedy: dividing logits by them would overflow.
_GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
# What torch.Generator.manual_seed takes (a signed or an unsigned 64-bit integer).
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
# Stop strings are searched in every step's new text, and bad words' prefixes matched each step:
# bounded so that one request cannot make every step slow.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_BAD_WORDS = 256
# OpenAI's range for a logit_bias value.
MAX_LOGIT_BIAS = 100.0


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2
    BEAM = 3


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {_short_repr(value)}")


def _short_repr(value: object) -> str:
    # A hostile value can be huge: the message quotes its start only.
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


# SamplingParams' scalar fields by kind, checked (and ints and floats normalized) in this order.
_INT_FIELDS = ("n", "top_k", "min_tokens")
_OPTIONAL_INT_FIELDS = (
    "best_of",
    "seed",
    "max_tokens",
    "logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
)
_FLOAT_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
    "length_penalty",
)
_BOOL_FIELDS = (
    "use_beam_search",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)


def as_int(value: object, name: str) -> int:
    """``value`` as a Python int: ints, numpy and torch integers (never bools, floats or strings)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be an integer, got {type(value).__name__} {_short_repr(value)}"
        ) from None


def as_float(value: object, name: str) -> float:
    """``value`` as a finite Python float (ints and numpy floats too; never bools, inf or nan)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {_short_repr(value)}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {result}")
    return result


def as_int_list(value: object, name: str) -> list[int]:
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list of integers, got {type(value).__name__}")
    return [as_int(item, name) for item in value]


def as_str_list(value: object, name: str, max_items: int, max_chars: int) -> list[str]:
    """A list of non-empty strings, at most ``max_items`` of at most ``max_chars`` characters."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"{name} must be a string or a list of strings, got {type(value).__name__}")
    _check(len(items) <= max_items, name, f"at most {max_items} strings", f"{len(items)} strings")
    for item in items:
        _check(isinstance(item, str) and item != "", name, "non-empty strings", item)
        _check(len(item) <= max_chars, name, f"strings of at most {max_chars} characters", f"{len(item)}")
    return list(items)


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrains a request's output to a formal language (vLLM's ``StructuredOutputsParams``).

    Exactly one is set:
        json: a JSON schema (a dict, or its JSON text); the output is a JSON value it accepts.
        regex: the output matches this regular expression.
        choice: the output is one of these strings.
        grammar: the output is a sentence of this EBNF grammar (GBNF, as llama.cpp writes it).
        json_object: the output is any JSON object (OpenAI's ``response_format`` json_object).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # The grammar compiled for the engine's tokenizer (structured_output's CompiledGrammar: an
    # llguidance matcher at its start), set when the engine validates the request; shared by
    # requests with the same constraint.
    compiled_grammar: Any = field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        # A compiled grammar holds a native matcher, and belongs to one process: the receiving
        # side compiles the constraint for itself.
        return {**self.__dict__, "compiled_grammar": None}

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        _check(
            len(given) == 1,
            "structured_outputs",
            "exactly one of json, regex, choice, grammar, json_object",
            given,
        )
        if self.json is not None:
            self.json = _json_schema_text(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, str) and value != ""),
                f"structured_outputs.{name}",
                "a non-empty string",
                value,
            )
        if self.choice is not None:
            self.choice = as_str_list(self.choice, "structured_outputs.choice", 1024, 4096)
            _check(bool(self.choice), "structured_outputs.choice", "a non-empty list", self.choice)
        _check(
            self.json_object in (None, True, False),
            "structured_outputs.json_object",
            "a boolean",
            self.json_object,
        )

    @property
    def kind(self) -> str:
        """Which of the fields is set."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))

    @property
    def spec(self) -> str:
        """The set field as text (the compiled-grammar cache's key, with ``kind``)."""
        value = getattr(self, self.kind)
        return json.dumps(value) if self.kind == "choice" else str(value)


def _json_schema_text(schema: object) -> str:
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json must be a JSON schema, and is not JSON: {e}") from None
    else:
        parsed = schema
    _check(
        isinstance(parsed, (dict, bool)),
        "structured_outputs.json",
        "a JSON schema (an object)",
        type(parsed).__name__,
    )
    try:
        return json.dumps(parsed)
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.json must be JSON-serialisable: {e}") from None


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request holds (vLLM's names)."""

    # Everything so far: text, token ids and logprobs since the start.
    CUMULATIVE = 0
    # Only what is new since the request's previous output (what a stream sends).
    DELTA = 1
    # Nothing until the request finishes, then everything.
    FINAL_ONLY = 2


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
        bad_words: words never generated: each is tokenized with and without a leading space; a
            one-token word is banned everywhere, a longer one's last token after its other tokens.
        allowed_token_ids: only these tokens may be generated.
        logit_bias: token id -> value in [-100, 100] added to its logit before sampling.
        truncate_prompt_tokens: keep only the prompt's last k tokens.
        structured_outputs: constrain the output to a JSON schema, regex, choice or grammar.
        output_kind: what each RequestOutput holds: everything so far (CUMULATIVE), only what
            is new since the last (DELTA), or nothing until the end (FINAL_ONLY).
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
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # bad_words as token-id sequences, set by the engine's request validation (it has the tokenizer).
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)
    # The best_of that _normalize filled in for None (n's value then); see verify().
    _defaulted_best_of: int | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Normalise and check every field; ValueError names the first that is wrong. Run at
        construction and again by the engine on every request, so that a SamplingParams changed
        after it was made (``params.temperature = -1``) is checked as a new one would be."""
        if self._defaulted_best_of is not None and self.best_of == self._defaulted_best_of:
            self.best_of = None  # still the default: it follows a changed n
        self._normalize()
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(
                f"output_kind must be one of {[kind.name for kind in RequestOutputKind]}, "
                f"got {self.output_kind!r}"
            ) from None
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

    def _normalize(self) -> None:
        """Coerce numpy/torch numbers to Python's and containers to lists; wrong types raise
        ValueError naming the field."""
        self._normalize_scalars()
        if self.best_of is None:
            self.best_of = self._defaulted_best_of = self.n
        self._normalize_lists()

    def _normalize_scalars(self) -> None:
        for name in _INT_FIELDS:
            setattr(self, name, as_int(getattr(self, name), name))
        for name in _OPTIONAL_INT_FIELDS:
            if getattr(self, name) is not None:
                setattr(self, name, as_int(getattr(self, name), name))
        for name in _FLOAT_FIELDS:
            setattr(self, name, as_float(getattr(self, name), name))
        for name in _BOOL_FIELDS:
            _check(isinstance(getattr(self, name), bool), name, "a boolean", getattr(self, name))

    def _normalize_lists(self) -> None:
        self.stop = (
            []
            if self.stop is None
            else as_str_list(self.stop, "stop", MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS)
        )
        self.stop_token_ids = (
            [] if self.stop_token_ids is None else as_int_list(self.stop_token_ids, "stop_token_ids")
        )
        if self.bad_words is not None:
            self.bad_words = as_str_list(self.bad_words, "bad_words", MAX_BAD_WORDS, MAX_STOP_STRING_CHARS)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = as_int_list(self.allowed_token_ids, "allowed_token_ids")
            _check(bool(self.allowed_token_ids), "allowed_token_ids", "None or a non-empty list", [])
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "None or a StructuredOutputsParams",
            self.structured_outputs,
        )

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
        _check(
            self.seed is None or MIN_SEED <= self.seed <= MAX_SEED,
            "seed",
            f"None or an integer in [{MIN_SEED}, {MAX_SEED}]",
            self.seed,
        )
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
        for name in ("stop_token_ids", "allowed_token_ids"):
            _check(
                all(t >= 0 for t in getattr(self, name) or []),
                name,
                "non-negative integers",
                getattr(self, name),
            )
        _check(
            self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
            "truncate_prompt_tokens",
            "None or an integer >= 1",
            self.truncate_prompt_tokens,
        )
        if self.structured_outputs is not None:
            _check(
                not self.use_beam_search,
                "structured_outputs",
                "None with beam search",
                self.structured_outputs.kind,
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
    def token_id_fields(self) -> dict[str, list[int]]:
        """Every token id the request names, by field: the engine checks them against the vocabulary."""
        return {
            "stop_token_ids": self.stop_token_ids,
            "allowed_token_ids": self.allowed_token_ids or [],
            "logit_bias": list(self.logit_bias or {}),
        }

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


# A logit_bias key as JSON carries a token id: an optional sign and up to 20 ASCII digits.
_TOKEN_ID_KEY = re.compile(r"\s*-?[0-9]{1,20}\s*")


def _logit_bias(logit_bias: object) -> dict[int, float]:
    """Token id (an int, or its decimal string as JSON keys are) -> finite bias in [-100, 100]."""
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(logit_bias).__name__}")
    result = {}
    for key, value in logit_bias.items():
        if isinstance(key, str):
            # ASCII digits only: str.isdigit() and int() also take "²" and Arabic-Indic digits.
            _check(_TOKEN_ID_KEY.fullmatch(key) is not None, "logit_bias", "keyed by token ids", key)
            key = int(key)
        token_id = as_int(key, "logit_bias")
        _check(token_id >= 0, "logit_bias", "keyed by non-negative token ids", token_id)
        bias = as_float(value, "logit_bias")
        _check(
            -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            bias,
        )
        result[token_id] = bias
    return result


@dataclass
class BeamSearchParams:
    """``LLM.beam_search``'s parameters (vLLM's names).

    Args:
        beam_width: beams kept each step; also the number of sequences returned.
        max_tokens: most tokens a beam generates.
        ignore_eos: keep extending beams past EOS.
        temperature: 0 only: beams are scored by unscaled logprobs here (vLLM also scales
            them by a temperature; that changes which beams win, so it is refused, not ignored).
        length_penalty: a finished beam scores ``cumulative_logprob / length ** length_penalty``.
        include_stop_str_in_output: keep a matched stop string in the text.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check(
            _is_int(self.beam_width) and self.beam_width >= 1,
            "beam_width",
            "an integer >= 1",
            self.beam_width,
        )
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            "an integer >= 1",
            self.max_tokens,
        )
        _check(
            self.temperature == 0.0,
            "temperature",
            "0 (beams are scored by unscaled logprobs)",
            self.temperature,
        )

    def to_sampling_params(self) -> SamplingParams:
        """The SamplingParams that run it: beam search of ``beam_width`` beams returning them all;
        one beam is greedy decoding (with logprobs, for the cumulative logprob)."""
        common = {
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "temperature": 0.0,
        }
        if self.beam_width == 1:
            return SamplingParams(logprobs=0, **common)
        return SamplingParams(
            n=self.beam_width,
            best_of=self.beam_width,
            use_beam_search=True,
            length_penalty=self.length_penalty,
            **common,
        )


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
