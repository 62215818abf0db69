"""One request's grammar state: which tokens may come next, advanced by each sampled token."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import llguidance
import numpy as np
import torch

from pagedllm.structured_output.bitmask import BITS_PER_WORD, allocate_token_bitmask
from pagedllm.structured_output.manager import CompiledGrammar


class StructuredOutputGrammar:
    """A request's matcher over its compiled grammar (vLLM's ``StructuredOutputGrammar``).

    Stop tokens never reach llguidance's matcher: it stops by itself once the grammar admits no
    more text, and then keeps a stop token out of its history (a rollback would undo a text token
    instead). Here a stop token is a processed token like the others, accepted where the grammar
    is complete, with nothing after it.

    Args:
        compiled: the grammar, compiled for this engine's tokenizer.
    """

    def __init__(self, compiled: CompiledGrammar) -> None:
        self._matcher = compiled.matcher.deep_copy()
        self._stop_token_ids = compiled.stop_token_ids
        self._terminated = False
        self.num_processed_tokens = 0

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (and the grammar left after the last accepted one)
        when one is outside the grammar, which a masked sampler never produces."""
        for token_id in token_ids:
            accepted = self.accept_unless_text(token_id)
            if accepted is None:
                # try_consume_tokens refuses a token outside the grammar; consume_token would also
                # leave the matcher in an error state for good.
                accepted = self._matcher.try_consume_tokens([token_id]) > 0
                self.num_processed_tokens += accepted
            if not accepted:
                return False
        return True

    def accept_unless_text(self, token_id: int) -> bool | None:
        """The verdict on a token the matcher never sees: none after termination; a stop token
        where the grammar is complete (which terminates it). None for a text token: the caller
        gives it to the matcher (``accept_tokens``, or ``GrammarBatch.advance`` for a batch)."""
        if self._terminated:
            return False
        if token_id not in self._stop_token_ids:
            return None
        if not self._matcher.is_accepting():
            return False
        self._terminated = True
        self.num_processed_tokens += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding rejects drafts)."""
        if num_tokens and self._terminated:
            self._terminated = False
            self.num_processed_tokens -= 1
            num_tokens -= 1
        self._matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens

    def is_terminated(self) -> bool:
        """The output is complete: the grammar accepted a stop token."""
        return self._terminated

    def reset(self) -> None:
        self._matcher.reset()
        self._terminated = False
        self.num_processed_tokens = 0


# Live rows from which the batched fill pays for its dispatch, about 50-70 us a call.
MIN_BATCHED_ROWS = 8


class GrammarBatch:
    """Fills a batch's bitmask rows through llguidance, which releases the GIL while it fills.

    A row's fill takes from a couple of microseconds (inside a plain string) to milliseconds
    (inside a string bounded by maxLength). Batches of at least ``MIN_BATCHED_ROWS`` rows go to
    llguidance's executor in one call, smaller ones row by row. On cheap rows the executor costs
    ~60 us more than the loop; on costly ones it saves milliseconds. It has one thread: more never
    paid. Median us to fill 32 rows, each method on its own matchers advanced by the same random
    allowed tokens (a matcher caches its last mask, so methods must not share one), SmolLM2's
    49,152 tokens, llguidance 1.9.1 (``benchmarks/grammar_fill.py``):

        CPU                          schema   row by row   1 thread   2      4      8
        H200 host (16 cores)         strict   175          238        275    275    327
                                     bounded  4,125        2,648      2,843  2,943  3,570
        development CPU (2 cores)    strict   166          156        253    194    266
                                     bounded  2,211        2,175      2,223  2,245  2,351
    """

    def __init__(self) -> None:
        self._executor = llguidance.LLExecutor(num_threads=1)

    def bitmask(
        self,
        grammars: Sequence[StructuredOutputGrammar | None],
        vocab_size: int,
        out: torch.Tensor | None = None,
        skip: Collection[int] = (),
    ) -> torch.Tensor:
        """The batch's bitmask [num_rows, ceil(vocab_size / 32)] on the host: a row per sampled
        sequence, all ones where it has no grammar or its grammar has terminated. Written into the
        first rows of ``out`` when given (a reused buffer), else into a new tensor; the rows in
        ``skip`` are left as they are (filled already)."""
        if out is not None and not (
            out.dtype == torch.int32
            and out.is_contiguous()
            and out.device.type == "cpu"
            and out.shape[1] == -(-vocab_size // BITS_PER_WORD)
            and out.shape[0] >= len(grammars)
        ):
            # llguidance writes through a raw pointer: a wrong buffer would be corrupted memory.
            raise ValueError(
                f"out must be a contiguous int32 host tensor [>= {len(grammars)}, ceil({vocab_size} / 32)]"
            )
        bitmask = allocate_token_bitmask(len(grammars), vocab_size) if out is None else out[: len(grammars)]
        rows = [
            row
            for row, g in enumerate(grammars)
            if g is not None and not g.is_terminated() and row not in skip
        ]
        if out is not None and len(rows) + len(skip) < len(grammars):
            # Through numpy: torch would wake its OpenMP pool for a fill this size, and its threads
            # spin on the cores afterwards.
            unconstrained = np.ones(len(grammars), dtype=bool)
            unconstrained[rows] = False
            unconstrained[list(skip)] = False
            bitmask.numpy()[unconstrained] = -1
        self.fill([(grammars[row], row) for row in rows], bitmask)
        return bitmask

    def fill(self, rows: Sequence[tuple[StructuredOutputGrammar, int]], bitmask: torch.Tensor) -> None:
        """Write each (grammar, row)'s mask into that row of ``bitmask`` (int32 on the host,
        contiguous, checked by the caller: llguidance writes through a raw pointer)."""
        # Straight into llguidance, not through its torch module, whose import makes torch.jit
        # emit deprecation warnings.
        matchers = [(grammar._matcher, row) for grammar, row in rows]
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        if len(matchers) >= MIN_BATCHED_ROWS:
            self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
        else:
            for matcher, row in matchers:
                matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)

    def advance(self, grammars: Sequence[StructuredOutputGrammar], token_ids: Sequence[int]) -> list[bool]:
        """Advance each grammar by its one token, as ``accept_tokens([token])`` would: whether
        it was accepted. From ``MIN_BATCHED_ROWS`` text tokens on they go to llguidance's executor
        in one call, which holds the GIL only to read its arguments (a loop of matcher calls
        holds it throughout, ~1-5 us a token). A matcher that refuses its token there is left in
        an error state, unlike ``accept_tokens``'s: the caller drops a grammar that refused."""
        stop_sets = {id(g._stop_token_ids): g._stop_token_ids for g in grammars}  # one, as a rule
        distinct = set(token_ids)
        if all(stop.isdisjoint(distinct) for stop in stop_sets.values()) and not any(
            g._terminated for g in grammars
        ):
            accepted: list[bool | None] = [None] * len(grammars)  # text tokens only: the usual step
        else:
            accepted = [grammar.accept_unless_text(token) for grammar, token in zip(grammars, token_ids)]
        text = [i for i, verdict in enumerate(accepted) if verdict is None]
        if len(text) >= MIN_BATCHED_ROWS:
            consumed = self._executor.consume_token_par([(grammars[i]._matcher, token_ids[i]) for i in text])
        else:
            consumed = [grammars[i]._matcher.try_consume_tokens([token_ids[i]]) > 0 for i in text]
        for i, ok in zip(text, consumed):
            accepted[i] = ok
            grammars[i].num_processed_tokens += ok
        return accepted  # type: ignore[return-value]  (no None left)
