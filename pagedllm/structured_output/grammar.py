"""One request's grammar state: which tokens may come next, advanced by each sampled token."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xgrammar as xgr

from pagedllm.structured_output.bitmask import allocate_token_bitmask


class StructuredOutputGrammar:
    """A request's matcher over its compiled grammar (vLLM's ``StructuredOutputGrammar``).

    Args:
        compiled: the grammar, compiled for this engine's tokenizer.
    """

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self.num_processed_tokens = 0

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (and the grammar left after the last accepted one)
        when one is outside the grammar, which a masked sampler never produces."""
        for token_id in token_ids:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token_id):
                return False
            self.num_processed_tokens += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding rejects drafts)."""
        self._matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens

    def is_terminated(self) -> bool:
        """The output is complete: the grammar accepted a stop token."""
        return self._matcher.is_terminated()

    def reset(self) -> None:
        self._matcher.reset()
        self.num_processed_tokens = 0


class GrammarBatch:
    """Fills many requests' bitmask rows in one call into xgrammar, with no GIL round trip a row.

    A fill takes from a few to hundreds of microseconds a row (6-400 us measured at SmolLM2's
    49,152 tokens), on one thread: xgrammar's own threads made it slower at every size measured
    (32 rows on a 16-core H200 host: median 0.25 ms a step on one thread, 0.49 ms on eight, and a
    strict-schema batch 2.7x slower end to end), and they compete for cores with torch's OpenMP
    pool, which spins after each CPU operator.
    """

    def __init__(self) -> None:
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def bitmask(
        self,
        grammars: Sequence[StructuredOutputGrammar | None],
        vocab_size: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The batch's bitmask [num_rows, ceil(vocab_size / 32)] on the host: a row per sampled
        sequence, all ones where it has no grammar or its grammar has terminated. Written into the
        first rows of ``out`` when given (a reused buffer), else into a new tensor."""
        bitmask = allocate_token_bitmask(len(grammars), vocab_size) if out is None else out[: len(grammars)]
        rows = [row for row, g in enumerate(grammars) if g is not None and not g.is_terminated()]
        if out is not None and len(rows) < len(grammars):
            # Through numpy: torch would wake its OpenMP pool for a fill this size, and its threads
            # spin on the cores afterwards.
            unconstrained = np.ones(len(grammars), dtype=bool)
            unconstrained[rows] = False
            bitmask.numpy()[unconstrained] = -1
        if rows:
            matchers = [grammars[row]._matcher for row in rows]
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return bitmask
