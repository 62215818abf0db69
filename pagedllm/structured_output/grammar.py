"""One request's grammar state: which tokens may come next, advanced by each sampled token."""

from __future__ import annotations

from collections.abc import Sequence

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
            if self._terminated:
                return False
            if token_id in self._stop_token_ids:
                if not self._matcher.is_accepting():
                    return False
                self._terminated = True
            # try_consume_tokens refuses a token outside the grammar; consume_token would also
            # leave the matcher in an error state for good.
            elif not self._matcher.try_consume_tokens([token_id]):
                return False
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
    ) -> torch.Tensor:
        """The batch's bitmask [num_rows, ceil(vocab_size / 32)] on the host: a row per sampled
        sequence, all ones where it has no grammar or its grammar has terminated. Written into the
        first rows of ``out`` when given (a reused buffer), else into a new tensor."""
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
        rows = [row for row, g in enumerate(grammars) if g is not None and not g.is_terminated()]
        if out is not None and len(rows) < len(grammars):
            # Through numpy: torch would wake its OpenMP pool for a fill this size, and its threads
            # spin on the cores afterwards.
            unconstrained = np.ones(len(grammars), dtype=bool)
            unconstrained[rows] = False
            bitmask.numpy()[unconstrained] = -1
        # Straight into llguidance, not through its torch module, whose import makes torch.jit
        # emit deprecation warnings.
        matchers = [(grammars[row]._matcher, row) for row in rows]
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        if len(matchers) >= MIN_BATCHED_ROWS:
            self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
        else:
            for matcher, row in matchers:
                matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)
        return bitmask
