"""Compiles requests' grammars in a thread pool and caches them.

A request with ``structured_outputs`` is compiled when it is validated (``compile``: a Future, so
the server awaits it off its event loop). Compilation runs in a worker thread, because a JSON
schema can take milliseconds to seconds; requests with the same constraint share one compilation
(an LRU of Futures). The worker then keeps a matcher per request, copied from the compiled one,
and fills the batch's bitmask each step (worker/request_logits.py). Matchers are the grammar
extension's where it builds (``native``), else llguidance's Python ``LLMatcher``.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from pagedllm.config import ModelConfig
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import native
from pagedllm.structured_output.bitmask import bitmask_words
from pagedllm.tokenizer import Tokenizer, get_eos_token_ids

# Compiled grammars kept for reuse; each holds a matcher at the grammar's start.
CACHE_SIZE = 256

# JSON is written with json.dumps' separators and no other whitespace: with free whitespace a weak
# model can emit spaces forever. Overrides, so a schema's "x-guidance" cannot turn it back on.
JSON_OVERRIDES = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Keywords the compiler does not implement (uniqueItems, say) are ignored rather than refused.
JSON_DEFAULTS = {"lenient": True}

# Keywords whose value is a schema, a list of schemas, or a map from names to schemas.
_SUBSCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A validated grammar for this engine's tokenizer.

    Attributes:
        matcher: a matcher at the grammar's start, never advanced: a request's matcher is its copy
            (under a microsecond, where building one from the grammar takes about 0.4 ms). The
            grammar extension's ``Matcher`` (``native``), or llguidance's ``LLMatcher``.
        stop_token_ids: the tokens that end a complete output.
    """

    matcher: Any
    stop_token_ids: frozenset[int]


class StructuredOutputManager:
    """Args:
    tokenizer: the engine's tokenizer (a fast Hugging Face tokenizer).
    vocab_size: the model's vocabulary (logits width), which may exceed the tokenizer's.
    stop_token_ids: tokens that end the output once the grammar is complete (EOS).
    max_workers: compile threads.
    """

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int], max_workers: int = 2
    ) -> None:
        self._stop_token_ids = frozenset(stop_token_ids)
        self._hf_tokenizer = tokenizer
        self._tokenizer: Any = None  # llguidance's view of the vocabulary (``_grammar_tokenizer``)
        self._tokenizer_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._cache: collections.OrderedDict[tuple[str, str], Future[CompiledGrammar]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        # The grammar extension's build started by prepare(); None: built by the first compile.
        self._native_build: Future[bool] | None = None

    @classmethod
    def for_model(
        cls, model_config: ModelConfig, tokenizer: Tokenizer | None
    ) -> StructuredOutputManager | None:
        """The manager for a model's vocabulary and EOS tokens; None without a tokenizer."""
        if tokenizer is None:
            return None
        return cls(tokenizer, model_config.vocab_size, get_eos_token_ids(model_config, tokenizer))

    def compile(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compiled grammar, shared by every request with the same constraint. The Future
        raises ValueError naming the field when the constraint does not compile."""
        key = (params.kind, params.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._executor.submit(self._compile, params)
                self._cache[key] = future
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
            return future

    def prepare(self) -> None:
        """Start building the grammar extension (about a minute, once per machine; loading a built
        one takes milliseconds) in a compile thread, so that no request's compile time limit pays
        for it. The server calls this at start-up and answers constrained requests 503 until
        ``is_ready``; offline, the first compilation builds it, with no limit to beat."""
        if native.is_built():
            native.available()  # loaded now: no request meets a build that is already done
            return
        with self._lock:
            if self._native_build is None:
                self._native_build = self._executor.submit(native.available)

    @property
    def is_ready(self) -> bool:
        """False while prepare()'s build runs."""
        return self._native_build is None or self._native_build.done()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _grammar_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, built by the first compilation (in a compile
        thread): about 0.1-0.4 s and, for SmolLM2's 49k tokens, 30-70 MB of resident memory that an
        engine serving no constrained request would hold for nothing. The grammar extension's
        tokenizer where it builds (which builds it on the machine's first call), else llguidance's
        ``LLTokenizer``."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                eos = sorted(self._stop_token_ids)
                if native.available():
                    self._tokenizer = native.new_tokenizer(self._hf_tokenizer, self.vocab_size, eos)
                else:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos
                    )
            return self._tokenizer

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        def fail(reason: str) -> ValueError:
            return ValueError(f"structured_outputs.{params.kind} does not compile: {reason}")

        try:
            grammar = _grammar(params)
        except Exception as e:  # the GBNF converter raises bare Exceptions
            raise fail(str(e)) from None
        # The grammar is only checked when a matcher is built: this one is every request's start.
        tokenizer = self._grammar_tokenizer()
        if isinstance(tokenizer, llguidance.LLTokenizer):
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        else:
            matcher = native.load().Matcher.create(tokenizer, grammar)
        if matcher.is_error():
            raise fail(_short(matcher.get_error()))
        # An empty rule body, say ("root ::= "): a request could only stop at once.
        mask = np.zeros(bitmask_words(self.vocab_size), dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        if self._stop_token_ids.issuperset(allowed.tolist()):
            raise fail("it matches only the empty output")
        return CompiledGrammar(matcher, self._stop_token_ids)


def _grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for the constraint (not yet checked)."""
    if params.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(
            _closed_objects(json.loads(params.json)), defaults=JSON_DEFAULTS, overrides=JSON_OVERRIDES
        )
    if params.kind == "json_object":
        # OpenAI's json_object: any object (not any JSON value).
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=JSON_DEFAULTS, overrides=JSON_OVERRIDES
        )
    if params.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.kind == "choice":
        # Lark string literals take JSON's escapes.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in params.choice)
        )
    # GBNF (llama.cpp's EBNF) is converted to Lark; a grammar already in Lark passes through.
    return llguidance.LLMatcher.grammar_from_lark(any_to_lark(params.grammar))


def _closed_objects(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` wherever it lists properties and says
    nothing of others: a model that may add keys of its own tends to go on adding them.
    (JSON Schema's default allows them; OpenAI's strict mode and xgrammar's do not.)"""
    if schema is True:
        return {}
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(closed.get(key), dict):
            closed[key] = _closed_objects(closed[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [_closed_objects(s) for s in closed[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: _closed_objects(s) for name, s in closed[key].items()}
    if ("properties" in closed or "patternProperties" in closed) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _short(error: str) -> str:
    """llguidance's error without its source location and grammar excerpt: the first line, and
    the reason of a regex parse error ("unclosed group"), which follows on a later line."""
    lines = error.strip().splitlines()
    first = lines[0].split("): ", 1)[-1] if lines[0].startswith("at ") else lines[0]
    reason = next((line[len("error: ") :] for line in lines[1:] if line.startswith("error: ")), None)
    return f"{first} {reason}" if reason else first
