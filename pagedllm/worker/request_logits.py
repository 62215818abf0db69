"""The per-request logits processors of a step's sample rows: allowed_token_ids, logit_bias,
bad_words and structured outputs' grammar bitmask, applied before the sampler.

Grammar state lives here, one matcher per request (a forked request gets its own), caught up each
step with the tokens its request generated since the last. The output history a grammar or bad
words read is the persistent batch's: the tokens the host sent, then the worker's own samples
(``InputBatch.append_sampled``), so these requests need no resend and no wait for the host between
steps. Compilation happened when the request was validated (``compiled_grammar``), in the engine's
process; a rank in a process of its own gets the constraint without its native matcher and
compiles it once more (``compile_grammar``; cached per constraint).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from pagedllm.sample.logits_processors import apply_allowed_token_ids, apply_bad_words, apply_logit_bias
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output import (
    CompiledGrammar,
    GrammarBatch,
    StructuredOutputGrammar,
    allocate_token_bitmask,
    apply_token_bitmask,
)

logger = logging.getLogger(__name__)


def has_logits_processors(params: SamplingParams) -> bool:
    return bool(
        params.allowed_token_ids
        or params.logit_bias
        or params.bad_words_token_ids
        or params.structured_outputs
    )


class RequestLogitsProcessors:
    """Args:
    compile_grammar: compiles a constraint that arrived without its compiled grammar.
    """

    def __init__(self, compile_grammar: Callable[[StructuredOutputsParams], CompiledGrammar]) -> None:
        self._compile_grammar = compile_grammar
        # req_id -> its grammar (None once its output left the grammar).
        self._grammars: dict[int, StructuredOutputGrammar | None] = {}
        self._grammar_batch: GrammarBatch | None = None  # made at the first grammar
        # On CUDA: two pinned host bitmasks used in turn, each with the event of its last copy.
        self._pinned: list[tuple[torch.Tensor, torch.cuda.Event]] = []

    def drop(self, req_ids: Iterable[int]) -> None:
        for req_id in req_ids:
            self._grammars.pop(req_id, None)

    def __call__(
        self,
        logits: torch.Tensor,
        req_ids: list[int],
        params: list[SamplingParams],
        output_token_ids: Callable[[int, int], list[int]],
    ) -> None:
        """logits: [num_rows, vocab_size], edited in place; the lists give each row's request and
        parameters, ``output_token_ids(i, start)`` row i's generated tokens from index start (read
        only as far as needed: a grammar wants the tokens since its last step, not the whole
        output)."""
        apply_allowed_token_ids(logits, [p.allowed_token_ids for p in params])
        apply_logit_bias(logits, [p.logit_bias for p in params])
        bad_words = [p.bad_words_token_ids for p in params]
        if any(bad_words):
            past = [output_token_ids(i, 0) if words else () for i, words in enumerate(bad_words)]
            apply_bad_words(logits, bad_words, past)
        grammars = [self._grammar(req_id, params[i], i, output_token_ids) for i, req_id in enumerate(req_ids)]
        if any(grammar is not None for grammar in grammars):
            if self._grammar_batch is None:
                self._grammar_batch = GrammarBatch()
            vocab_size = logits.shape[1]
            if logits.device.type != "cuda":
                apply_token_bitmask(logits, self._grammar_batch.bitmask(grammars, vocab_size))
                return
            buffer = self._pinned_buffer(len(grammars), vocab_size)
            apply_token_bitmask(logits, self._grammar_batch.bitmask(grammars, vocab_size, out=buffer))
            event = torch.cuda.Event()
            event.record()
            self._pinned.append((buffer, event))

    def _pinned_buffer(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        """A pinned host bitmask of at least ``num_rows`` rows whose last copy to the device is done.

        From pinned memory the copy is asynchronous; from pageable memory it would wait for the
        device to reach it, i.e. for the step's forward pass, and the host's work would stop
        overlapping the device's. Two buffers in turn: the one filled now may still be read by
        the step in flight.
        """
        if len(self._pinned) == 2:
            buffer, event = self._pinned.pop(0)
            event.synchronize()
            if buffer.shape[0] >= num_rows:
                return buffer
        return allocate_token_bitmask(max(num_rows, 64), vocab_size, pin_memory=True)

    def _grammar(
        self,
        req_id: int,
        params: SamplingParams,
        index: int,
        output_token_ids: Callable[[int, int], list[int]],
    ) -> StructuredOutputGrammar | None:
        structured = params.structured_outputs
        if structured is None:
            return None
        if req_id not in self._grammars:
            if structured.compiled_grammar is None:
                structured.compiled_grammar = self._compile_grammar(structured)
            self._grammars[req_id] = StructuredOutputGrammar(structured.compiled_grammar)
        grammar = self._grammars[req_id]
        if grammar is None:
            return None
        new_tokens = output_token_ids(index, grammar.num_processed_tokens)
        if new_tokens and not grammar.accept_tokens(new_tokens):
            # Only a token the mask did not allow (e.g. EOS forced by max_tokens) gets here.
            logger.warning("request %d: output left its grammar; no longer constrained", req_id)
            self._grammars[req_id] = None
            return None
        return grammar
