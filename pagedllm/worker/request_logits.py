"""The per-request logits processors of a step's sample rows: allowed_token_ids, logit_bias,
bad_words and structured outputs' grammar bitmask, applied before the sampler.

Grammar state lives here, one matcher per request (a forked request gets its own), caught up each
step with the tokens its request generated since the last. The output history a grammar or bad
words read is the persistent batch's: the tokens the host sent, then the worker's own samples
(``InputBatch.append_sampled``), so these requests need no resend and no wait for the host between
steps. Compilation happened when the request was validated (``compiled_grammar``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pagedllm.sample.logits_processors import apply_allowed_token_ids, apply_bad_words, apply_logit_bias
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import (
    GrammarBatch,
    StructuredOutputGrammar,
    allocate_token_bitmask,
    apply_token_bitmask,
)

logger = logging.getLogger(__name__)

# Masks filled a step ahead: per request, its row in the bitmask and how many tokens its grammar
# had processed; and the bitmask (None when nothing was filled).
Ahead = tuple[dict[int, tuple[int, int]], torch.Tensor | None]


def has_logits_processors(params: SamplingParams) -> bool:
    return bool(
        params.allowed_token_ids
        or params.logit_bias
        or params.bad_words_token_ids
        or params.structured_outputs
    )


class RequestLogitsProcessors:
    """Applies the step's per-request logits processors; fills grammar bitmasks a step ahead.

    A grammar's next mask needs the token its request just sampled, so it cannot be filled
    before the previous step's samples reach the host; filled when the step samples, it would add
    to the host's critical path (0.25 ms a step for 32 strict JSON rows, milliseconds with
    bounded strings). ``fill_ahead``, called as a step's sampling is launched, hands the work to a
    thread: wait for those samples, advance each grammar over its token, fill its next mask. The
    engine meanwhile processes outputs and schedules, and the next step picks the masks up (or
    fills inline the rows the thread could not: new requests, rows whose history moved on).
    """

    def __init__(self) -> None:
        # req_id -> its grammar (None once its output left the grammar).
        self._grammars: dict[int, StructuredOutputGrammar | None] = {}
        self._grammar_batch: GrammarBatch | None = None  # made at the first grammar
        self._vocab_size = 0
        # On CUDA: two pinned host bitmasks used in turn, each with the event of its last copy.
        self._pinned: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        # The masks being filled ahead: a future of the bitmask and, per request, its row and the
        # tokens its grammar had processed. While it runs only its thread touches the grammars,
        # and drops wait for it.
        self._executor: ThreadPoolExecutor | None = None
        self._ahead: Future[Ahead] | None = None
        self._pending_drops: set[int] = set()

    def drop(self, req_ids: Iterable[int]) -> None:
        self._pending_drops.update(req_ids)
        if self._ahead is None:
            self._apply_drops()

    def fill_ahead(
        self, sampled_token_ids: Callable[[], list[int]], samples: list[tuple[int, int, int]]
    ) -> None:
        """Start filling the next masks of this step's grammar requests on a thread.

        Args:
            sampled_token_ids: the step's sampled ids, waiting for them (the step's samples).
            samples: (req_id, output index, sample row) of each request with processors.
        """
        self._join()
        rows = [sample for sample in samples if self._grammars.get(sample[0]) is not None]
        if not rows or self._grammar_batch is None:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-fill")
        self._ahead = self._executor.submit(self._fill_ahead, sampled_token_ids, rows)

    def _fill_ahead(
        self, sampled_token_ids: Callable[[], list[int]], rows: list[tuple[int, int, int]]
    ) -> Ahead:
        token_ids = sampled_token_ids()
        filled: dict[int, tuple[int, int]] = {}
        grammars = []
        for req_id, output_index, row in rows:
            grammar = self._grammars[req_id]
            # Only a grammar caught up to just before this token advances here; the others
            # catch up from the output history when they next sample.
            if grammar is None or grammar.num_processed_tokens != output_index:
                continue
            if not grammar.accept_tokens([token_ids[row]]):
                continue  # left its grammar: the next step's catch-up says so and drops it
            if not grammar.is_terminated():
                filled[req_id] = (len(grammars), grammar.num_processed_tokens)
                grammars.append(grammar)
        assert self._grammar_batch is not None
        return filled, self._grammar_batch.bitmask(grammars, self._vocab_size)

    def _join(self) -> Ahead:
        """Wait for the masks being filled ahead (none: empty), then apply the drops."""
        ahead: Ahead = ({}, None)
        if self._ahead is not None:
            ahead = self._ahead.result()
            self._ahead = None
        self._apply_drops()
        return ahead

    def _apply_drops(self) -> None:
        for req_id in self._pending_drops:
            self._grammars.pop(req_id, None)
        self._pending_drops.clear()

    def __call__(
        self,
        logits: torch.Tensor,
        req_ids: list[int],
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
    ) -> None:
        """logits: [num_rows, vocab_size], edited in place; the lists give each row's request,
        parameters and generated tokens."""
        ahead, ahead_bitmask = self._join()
        apply_allowed_token_ids(logits, [p.allowed_token_ids for p in params])
        apply_logit_bias(logits, [p.logit_bias for p in params])
        apply_bad_words(logits, [p.bad_words_token_ids for p in params], output_token_ids)
        grammars = [self._grammar(*row) for row in zip(req_ids, params, output_token_ids)]
        if all(grammar is None for grammar in grammars):
            return
        if self._grammar_batch is None:
            self._grammar_batch = GrammarBatch()
        self._vocab_size = vocab_size = logits.shape[1]
        # Rows filled ahead whose grammar has not moved since are copied; the others filled here.
        copied = [
            (row, ahead[req_id][0])
            for row, (req_id, grammar) in enumerate(zip(req_ids, grammars))
            if grammar is not None and ahead.get(req_id, (0, -1))[1] == grammar.num_processed_tokens
        ]
        to_fill = list(grammars)
        for row, _ in copied:
            to_fill[row] = None
        on_cuda = logits.device.type == "cuda"
        buffer = self._pinned_buffer(len(grammars), vocab_size) if on_cuda else None
        bitmask = self._grammar_batch.bitmask(to_fill, vocab_size, out=buffer)
        if copied:
            assert ahead_bitmask is not None
            rows, sources = zip(*copied)
            bitmask.numpy()[list(rows)] = ahead_bitmask.numpy()[list(sources)]
        apply_token_bitmask(logits, bitmask)
        if buffer is not None:
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
        self, req_id: int, params: SamplingParams, output_token_ids: list[int]
    ) -> StructuredOutputGrammar | None:
        structured = params.structured_outputs
        if structured is None or structured.compiled_grammar is None:
            return None
        if req_id not in self._grammars:
            self._grammars[req_id] = StructuredOutputGrammar(structured.compiled_grammar)
        grammar = self._grammars[req_id]
        if grammar is None:
            return None
        new_tokens = output_token_ids[grammar.num_processed_tokens :]
        if new_tokens and not grammar.accept_tokens(new_tokens):
            # Only a token the mask did not allow (e.g. EOS forced by max_tokens) gets here.
            logger.warning("request %d: output left its grammar; no longer constrained", req_id)
            self._grammars[req_id] = None
            return None
        return grammar
