"""One request's grammar state: which tokens may come next, advanced by each sampled token.

Callers see a grammar through its public API alone (``accept_tokens``, ``rollback``,
``is_terminated``, ``stop_token_ids``, ``num_processed_tokens``); the matcher behind it is touched
only in this module, by the two things that work on many grammars at once without the GIL:
``GrammarBatch`` (fills a step's bitmask rows) and ``GrammarAheadWorker`` (the grammar extension's
ahead thread, which advances grammars by their samples and fills their next rows).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from pagedllm.structured_output import native
from pagedllm.structured_output.bitmask import allocate_token_bitmask, bitmask_words
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
        # The grammar extension's matcher (which the ahead thread can advance), not llguidance's
        # LLMatcher.
        self.is_native = not isinstance(self._matcher, llguidance.LLMatcher)

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end the output where the grammar is complete."""
        return self._stop_token_ids

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (and the grammar left after the last accepted one)
        when one is outside the grammar, which a masked sampler never produces."""
        for token_id in token_ids:
            accepted = self._accept_unless_text(token_id)
            if accepted is None:
                # try_consume_tokens refuses a token outside the grammar; consume_token would also
                # leave the matcher in an error state for good.
                accepted = self._matcher.try_consume_tokens([token_id]) > 0
                self.num_processed_tokens += accepted
            if not accepted:
                return False
        return True

    def _accept_unless_text(self, token_id: int) -> bool | None:
        """The verdict on a token the matcher never sees: none after termination; a stop token
        where the grammar is complete (which terminates it). None for a text token: the caller
        gives it to the matcher."""
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

    def _advanced_ahead(self, terminated: bool) -> None:
        # The ahead thread took a token into the matcher (or, terminated, a stop token past it).
        self.num_processed_tokens += 1
        if terminated:
            self._terminated = True


# Live rows from which llguidance's executor pays for its dispatch, about 50-70 us a call.
MIN_BATCHED_ROWS = 8


class GrammarBatch:
    """Fills a batch's bitmask rows without the GIL.

    A row's fill takes from a couple of microseconds (inside a plain string) to milliseconds
    (inside a string bounded by maxLength). The grammar extension's matchers fill in one call, row
    after row. ``LLMatcher``s (where the extension is unavailable) go to llguidance's executor in
    one call from ``MIN_BATCHED_ROWS`` rows, row by row below: on cheap rows the executor costs
    ~60 us more than the loop; on costly ones it saves milliseconds. It has one thread: more never
    paid. Median us to fill 32 ``LLMatcher`` rows, each method on its own matchers advanced by the
    same random allowed tokens (a matcher caches its last mask, so methods must not share one),
    SmolLM2's 49,152 tokens, llguidance 1.9.1 (``benchmarks/grammar_fill.py``):

        CPU                          schema   row by row   1 thread   2      4      8
        H200 host (16 cores)         strict   175          238        275    275    327
                                     bounded  4,125        2,648      2,843  2,943  3,570
        development CPU (2 cores)    strict   166          156        253    194    266
                                     bounded  2,211        2,175      2,223  2,245  2,351
    """

    def __init__(self) -> None:
        self._executor: llguidance.LLExecutor | None = None  # made for the first LLMatcher batch

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
            and out.shape[1] == bitmask_words(vocab_size)
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
        if not rows:
            return
        matchers = [grammar._matcher for grammar, _ in rows]
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        if not isinstance(matchers[0], llguidance.LLMatcher):
            native.load().fill_masks(
                matchers, [row for _, row in rows], bitmask.data_ptr(), row_bytes, bitmask.shape[0]
            )
        elif len(matchers) >= MIN_BATCHED_ROWS:
            # Straight into llguidance, not through its torch module, whose import makes
            # torch.jit emit deprecation warnings.
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=1)
            pairs = [(matcher, row) for matcher, (_, row) in zip(matchers, rows)]
            self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
        else:
            for matcher, (_, row) in zip(matchers, rows):
                matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)


@dataclass
class AheadResult:
    """What an ahead job did, grammar by grammar in the job's order (already applied to them)."""

    token_ids: list[int]  # the samples
    accepted: list[bool]  # False: the sample left the grammar
    rows: list[int]  # of each grammar's next mask; -1: none (the grammar ended or was left)
    # Every grammar took its sample as text: its next mask is at its row (``rows`` is the job's).
    all_consumed: bool


class GrammarAheadWorker:
    """The grammar extension's ahead thread (``native``'s ``AheadWorker``) over grammars.

    ``submit`` hands it a step's native grammars and the host buffer their samples land in (-1
    until a device copy writes them); the thread advances each grammar by its sample and writes
    its next mask into ``bitmask`` at its mask row, while the caller goes on. ``wait`` collects
    the job and records what the thread did in the grammars (their processed tokens and
    termination), so a grammar reads the same as after ``accept_tokens``.

    Args:
        vocab_size: the logits' width.
        timeout_s: how long the thread waits for a step's samples (a step that failed).
    """

    def __init__(self, vocab_size: int, timeout_s: float = native.SAMPLES_TIMEOUT_S) -> None:
        self._vocab_size = vocab_size
        self._timeout_s = timeout_s
        self._worker = None  # made at the first job: its stop tokens are the grammars'
        self._grammars: list[StructuredOutputGrammar] = []  # the last job's
        self._mask_rows: list[int] = []

    def submit(
        self,
        samples: torch.Tensor,
        grammars: list[StructuredOutputGrammar],
        sample_rows: list[int],
        bitmask: torch.Tensor,
        mask_rows: list[int] | None = None,
    ) -> None:
        """Advance ``grammars[i]`` by ``samples[sample_rows[i]]`` and fill its next mask into
        ``bitmask[mask_rows[i]]`` (default: its sample row). samples: int64 on the host; bitmask:
        int32 on the host, contiguous; both must live until ``wait`` returns."""
        assert samples.dtype == torch.int64 and samples.is_contiguous() and samples.device.type == "cpu"
        assert all(grammar.is_native for grammar in grammars)
        if self._worker is None:
            stop_token_ids = sorted(set().union(*(grammar.stop_token_ids for grammar in grammars)))
            self._worker = native.load().AheadWorker(stop_token_ids, self._vocab_size, self._timeout_s)
        self._grammars = list(grammars)
        self._mask_rows = list(sample_rows if mask_rows is None else mask_rows)
        self._worker.submit(
            samples.data_ptr(),
            samples.numel(),
            [grammar._matcher for grammar in grammars],
            sample_rows,
            self._mask_rows,
            bitmask.data_ptr(),
            bitmask.shape[1] * bitmask.element_size(),
            bitmask.shape[0],
        )

    def resubmit(self, samples: torch.Tensor, bitmask: torch.Tensor) -> None:
        """The last job's grammars and rows again, on a new step's samples (the steady state of
        decoding: no per-grammar work to hand the thread)."""
        assert self._worker is not None, "submit() first"
        self._worker.resubmit(samples.data_ptr(), samples.numel(), bitmask.data_ptr(), bitmask.shape[0])

    def wait(self) -> AheadResult | None:
        """The submitted job, once done (waiting without the GIL); None when its samples never
        landed (the step failed): its grammars are then as they were."""
        statuses, token_ids = self._worker.wait()
        extension = native.load()
        if statuses[0] == extension.TIMED_OUT:
            return None
        consumed = extension.CONSUMED
        if statuses.count(consumed) == len(statuses):  # the usual step: every sample was text
            for grammar in self._grammars:
                grammar._advanced_ahead(terminated=False)
            return AheadResult(token_ids, [True] * len(statuses), self._mask_rows, all_consumed=True)
        rows = [-1] * len(statuses)
        for i, (grammar, status) in enumerate(zip(self._grammars, statuses)):
            if status == consumed:
                grammar._advanced_ahead(terminated=False)
                rows[i] = self._mask_rows[i]
            elif status == extension.TERMINATED:
                grammar._advanced_ahead(terminated=True)
        accepted = [status != extension.REFUSED for status in statuses]
        return AheadResult(token_ids, accepted, rows, all_consumed=False)
