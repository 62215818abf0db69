"""Compiles requests' grammars in a thread pool and caches them.

A request with ``structured_outputs`` is compiled when it is validated (``compile``: a Future, so
the server awaits it off its event loop). Compilation runs in a worker thread, because a JSON
schema can take milliseconds to seconds; requests with the same constraint share one compilation
(an LRU of Futures). The worker then keeps a matcher per request over the compiled grammar and
fills the batch's bitmask each step (worker/request_logits.py).
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.tokenizer import Tokenizer

# Compiled grammars kept for reuse; a JSON schema's takes tens of KiB.
CACHE_SIZE = 256


class StructuredOutputManager:
    """Args:
    tokenizer: the engine's tokenizer.
    vocab_size: the model's vocabulary (logits width), which may exceed the tokenizer's.
    stop_token_ids: tokens that end the output once the grammar is complete (EOS).
    max_workers: compile threads.
    """

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int], max_workers: int = 2
    ) -> None:
        tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        # Our own cache of Futures replaces xgrammar's: it also merges compilations in flight.
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._cache: collections.OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        self.vocab_size = vocab_size

    def compile(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
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

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        try:
            if params.kind == "json":
                # Compact JSON only: with free whitespace a weak model can emit spaces forever.
                return self._compiler.compile_json_schema(params.json, any_whitespace=False)
            if params.kind == "json_object":
                # OpenAI's json_object: any object (not any JSON value).
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if params.kind == "regex":
                return self._compiler.compile_regex(params.regex)
            if params.kind == "choice":
                # EBNF string literals take JSON's escapes.
                return self._compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in params.choice)
                )
            return self._compiler.compile_grammar(params.grammar)
        except RuntimeError as e:
            # xgrammar's message leads with its source location: keep the reason only.
            reason = str(e).split("] ", 1)[-1].split(": ", 1)[-1].strip()
            raise ValueError(f"structured_outputs.{params.kind} does not compile: {reason}") from None
