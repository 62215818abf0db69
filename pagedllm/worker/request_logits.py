"""The per-request logits processors of a step's sample rows: allowed_token_ids, logit_bias,
bad_words and structured outputs' grammar bitmask, applied before the sampler.

Grammar state lives here, one matcher per request (a forked request gets its own), caught up each
step with the tokens its request generated since the last. The output history a grammar or bad
words read is the persistent batch's: the tokens the host sent, then the worker's own samples
(``InputBatch.append_sampled``), so these requests need no resend and no wait for the host between
steps. Compilation happened when the request was validated (``compiled_grammar``), in the engine's
process; a rank in a process of its own gets the constraint without its native matcher and
compiles it once more (``compile_grammar``; cached per constraint).

On CUDA a grammar's next mask is made ahead (``start_ahead``): once a step's sampler is launched, a
thread waits for the samples, advances each decoding request's grammar by its sample and fills the
next masks into the pinned buffer the next step will copy from, at the rows the samples had,
while this thread finishes the step, processes the last one's outputs, and schedules and launches
the next. The next step's processors then only fill the rows that moved or are new. The thread
holds the GIL only around llguidance's batched calls (reading a few lists): a thread that advanced
the grammars one matcher call at a time held it for ~100 us a step, and slowed the launching
thread more than the overlap gained.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

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


@dataclass
class _Ahead:
    """One step's grammars, each advanced by its sample off the step's thread, and their next
    masks in ``bitmask`` at the rows their samples had."""

    bitmask: torch.Tensor  # on the host; pinned on CUDA
    index: dict[int, int]  # req_id -> its position in the lists below
    grammars: list[StructuredOutputGrammar]
    token_ids: list[int]  # the samples
    accepted: list[bool]  # False: the sample left the grammar
    rows: list[int]  # of the next mask in ``bitmask``; -1: none (the grammar ended or was left)


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
    fill_ahead: make decoding grammars' next masks on a thread (``start_ahead``); for CUDA, whose
        steps run while the host prepares the next.
    """

    def __init__(
        self, compile_grammar: Callable[[StructuredOutputsParams], CompiledGrammar], fill_ahead: bool = False
    ) -> None:
        self._compile_grammar = compile_grammar
        self.fill_ahead = fill_ahead
        # req_id -> its grammar (None once its output left the grammar).
        self._grammars: dict[int, StructuredOutputGrammar | None] = {}
        self._grammar_batch: GrammarBatch | None = None  # made at the first grammar
        self._vocab_size = 0  # the logits' width, known at the first grammar
        self._pin_memory = False  # bitmasks in pinned memory: for logits on CUDA
        # Two pinned host bitmasks used in turn, each with the event of its last copy.
        self._pinned: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._ahead_thread: ThreadPoolExecutor | None = None
        self._ahead: Future[_Ahead] | None = None

    def drop(self, req_ids: Iterable[int]) -> None:
        for req_id in req_ids:
            self._grammars.pop(req_id, None)

    def __call__(
        self,
        logits: torch.Tensor,
        req_ids: list[int],
        params: list[SamplingParams],
        output_token_ids: Callable[[int, int], list[int]],
        num_output_tokens: Sequence[int],
    ) -> None:
        """logits: [num_rows, vocab_size], edited in place; the lists give each row's request and
        parameters, ``output_token_ids(i, start)`` row i's generated tokens from index start (read
        only as far as needed: a grammar wants the tokens since its last step, not the whole
        output), ``num_output_tokens[i]`` how many there are."""
        apply_allowed_token_ids(logits, [p.allowed_token_ids for p in params])
        apply_logit_bias(logits, [p.logit_bias for p in params])
        bad_words = [p.bad_words_token_ids for p in params]
        if any(bad_words):
            past = [output_token_ids(i, 0) if words else () for i, words in enumerate(bad_words)]
            apply_bad_words(logits, bad_words, past)
        ahead = self._take_ahead()
        rows = [
            self._grammar(req_id, params[i], i, output_token_ids, num_output_tokens[i], ahead)
            for i, req_id in enumerate(req_ids)
        ]
        if all(grammar is None for grammar, _ in rows):
            return
        if self._grammar_batch is None:
            self._grammar_batch = GrammarBatch()
            self._vocab_size = logits.shape[1]
            self._pin_memory = logits.device.type == "cuda"
        # Rows whose mask was made ahead stay where the thread wrote them or move; the others are
        # filled now.
        ahead_rows = {i: source for i, (_, source) in enumerate(rows) if source >= 0}
        if ahead is not None and ahead.bitmask.shape[0] >= len(rows):
            buffer = ahead.bitmask
            moves = {i: source for i, source in ahead_rows.items() if i != source}
        else:
            buffer = self._mask_buffer(len(rows))
            moves = ahead_rows
        if moves:
            assert ahead is not None
            moved = ahead.bitmask.numpy()[list(moves.values())]  # a copy: sources may be overwritten
        bitmask = self._grammar_batch.bitmask(
            [grammar for grammar, _ in rows], self._vocab_size, out=buffer, skip=ahead_rows.keys()
        )
        if moves:
            bitmask.numpy()[list(moves)] = moved
        apply_token_bitmask(logits, bitmask)
        if self._pin_memory:
            event = torch.cuda.Event()
            event.record()
            self._pinned.append((buffer, event))

    def start_ahead(
        self, sampled_token_ids: Callable[[], list[int]], samples: list[tuple[int, int, int]]
    ) -> None:
        """Advance the grammars of this step's samples and fill their next masks on a thread.

        sampled_token_ids: the step's samples, waiting for their copy to the host; samples:
        (req_id, output index, sample row) of each request with logits processors. Only a grammar
        that stands just before its sample is advanced: one caught up by this step's processors.
        """
        self._take_ahead()  # a step without these requests' rows left it untaken
        entries = []
        for req_id, output_index, row in samples:
            grammar = self._grammars.get(req_id)
            if (
                grammar is not None
                and not grammar.is_terminated()
                and grammar.num_processed_tokens == output_index
            ):
                entries.append((req_id, grammar, row))
        if not entries:
            return
        if self._ahead_thread is None:
            self._ahead_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-ahead")
        bitmask = self._mask_buffer(max(row for _, _, row in entries) + 1)
        self._ahead = self._ahead_thread.submit(self._advance_and_fill, sampled_token_ids, entries, bitmask)

    def _advance_and_fill(
        self,
        sampled_token_ids: Callable[[], list[int]],
        entries: list[tuple[int, StructuredOutputGrammar, int]],
        bitmask: torch.Tensor,
    ) -> _Ahead:
        """On the ahead thread."""
        all_token_ids = sampled_token_ids()  # waits for the copy, GIL released
        assert self._grammar_batch is not None
        req_ids, grammars, sample_rows = (list(column) for column in zip(*entries))
        token_ids = [all_token_ids[row] for row in sample_rows]
        accepted = self._grammar_batch.advance(grammars, token_ids)
        rows = [
            row if ok and not grammar.is_terminated() else -1
            for grammar, ok, row in zip(grammars, accepted, sample_rows)
        ]
        self._grammar_batch.fill(
            [(grammar, row) for grammar, row in zip(grammars, rows) if row >= 0], bitmask
        )
        index = {req_id: i for i, req_id in enumerate(req_ids)}
        return _Ahead(bitmask, index, grammars, token_ids, accepted, rows)

    def _take_ahead(self) -> _Ahead | None:
        """The masks made ahead since the last step (waits for the thread)."""
        if self._ahead is None:
            return None
        ahead, self._ahead = self._ahead, None
        return ahead.result()

    def _mask_buffer(self, num_rows: int) -> torch.Tensor:
        """A host bitmask of at least ``num_rows`` rows; on CUDA a pinned one whose last copy to
        the device is done.

        From pinned memory the copy is asynchronous; from pageable memory it would wait for the
        device to reach it, i.e. for the step's forward pass, and the host's work would stop
        overlapping the device's. Two buffers in turn: the one filled now may still be read by
        the step in flight.
        """
        if not self._pin_memory:
            return allocate_token_bitmask(num_rows, self._vocab_size)
        if len(self._pinned) == 2:
            buffer, event = self._pinned.pop(0)
            event.synchronize()
            if buffer.shape[0] >= num_rows:
                return buffer
        return allocate_token_bitmask(max(num_rows, 64), self._vocab_size, pin_memory=True)

    def _grammar(
        self,
        req_id: int,
        params: SamplingParams,
        index: int,
        output_token_ids: Callable[[int, int], list[int]],
        num_output_tokens: int,
        ahead: _Ahead | None,
    ) -> tuple[StructuredOutputGrammar | None, int]:
        """Row ``index``'s grammar caught up with its output (None: unconstrained), and the row
        of its next mask in ``ahead.bitmask`` (-1: none, fill it)."""
        structured = params.structured_outputs
        if structured is None:
            return None, -1
        grammar = self._grammars.get(req_id)
        position = None if ahead is None or grammar is None else ahead.index.get(req_id)
        new_tokens = None
        if position is not None and ahead.grammars[position] is grammar:
            if not ahead.accepted[position]:
                return self._left_grammar(req_id), -1
            if grammar.num_processed_tokens == num_output_tokens and not params.use_beam_search:
                return grammar, ahead.rows[position]  # nothing new since the sample
            since = output_token_ids(index, grammar.num_processed_tokens - 1)
            if since[:1] == [ahead.token_ids[position]]:
                new_tokens = since[1:]
            else:  # the host has another token there (a continuation it chose): start over
                del self._grammars[req_id]
                position = None
        else:
            position = None
        if req_id not in self._grammars:
            if structured.compiled_grammar is None:
                structured.compiled_grammar = self._compile_grammar(structured)
            self._grammars[req_id] = StructuredOutputGrammar(structured.compiled_grammar)
        grammar = self._grammars[req_id]
        if grammar is None:
            return None, -1
        if new_tokens is None:
            new_tokens = output_token_ids(index, grammar.num_processed_tokens)
        if new_tokens and not grammar.accept_tokens(new_tokens):
            return self._left_grammar(req_id), -1
        return grammar, -1 if position is None or new_tokens else ahead.rows[position]

    def _left_grammar(self, req_id: int) -> None:
        # Only a token the mask did not allow (e.g. EOS forced by max_tokens) gets here.
        logger.warning("request %d: output left its grammar; no longer constrained", req_id)
        self._grammars[req_id] = None
