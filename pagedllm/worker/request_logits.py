"""The worker's side of the logits-constraint seam (sample/constraints.py): a step's
constraints over the persistent batch's sample rows (``RequestLogitsProcessors``), and structured
outputs' grammars as a constraint (``GrammarConstraint``), whose bitmask the sampler applies (its
fused pass reads it).

Grammar state lives here, one matcher per request (a forked request gets its own), caught up each
step with the tokens its request generated since the last. The output history a grammar or bad
words read is the persistent batch's: the tokens the host sent, then the worker's own samples
(``InputBatch.append_sampled``), so these requests need no resend and no wait for the host between
steps. Compilation happened when the request was validated (``compiled_grammar``); a rank 0 in a
process of its own gets the constraint without its native matcher and compiles it there
(``grammar_ranks.RankGrammarCompiler``); under tensor parallelism the other ranks only receive
rank 0's bitmask (``grammar_ranks``).

On CUDA a grammar's next mask is made ahead (``after_launch``): once a step's sampler is launched,
a native thread (the grammar extension's ``AheadWorker``) waits for the samples, advances each
decoding request's grammar by its sample and fills the next masks into the pinned buffer the next
step will copy from, at the rows the samples had, while this thread finishes the step, processes
the last one's outputs, and schedules and launches the next. The next step's processors then only
fill the rows that moved or are new; in the steady state of decoding (every grammar row advanced
ahead, at its row) they do no per-row work, and the next job reuses the last one's matchers and
rows (``AheadWorker.resubmit``). The thread never takes the GIL: a Python thread doing the same
(through llguidance's batched calls, which release it) had to take it back after each call, and
each handoff stalled this thread by ~20 us, several times a step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pagedllm.sample.constraints import (
    AllowedTokenIds,
    BadWords,
    ConstraintRows,
    LogitBias,
    LogitsConstraint,
    LogitsConstraints,
    SampledRequest,
)
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output import (
    CompiledGrammar,
    GrammarAheadWorker,
    GrammarBatch,
    StructuredOutputGrammar,
    allocate_token_bitmask,
    native,
)
from pagedllm.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


class SampleRows(Protocol):
    """Which rows a step samples (the runner's ``ModelInput``)."""

    sample_req_ids: list[int]  # per sample row
    sample_rows: np.ndarray  # per sample row, its batch row
    sampling_req_rows: np.ndarray  # per sampling request, its batch row
    first_sample_index: np.ndarray  # per sampling request, its first sample row


class StepSamples(Protocol):
    """A launched step's samples on their way to the host (the runner's ``StepOutput``)."""

    def samples_on_host(self) -> torch.Tensor: ...

    def sampled_token_ids(self) -> list[int]: ...


@dataclass
class _AheadJob:
    """What the ahead thread works on; the tensors stay referenced until it is collected."""

    samples: torch.Tensor  # the step's samples on the host, -1 until they land
    bitmask: torch.Tensor  # on the host; pinned on CUDA
    req_ids: list[int]
    grammars: list[StructuredOutputGrammar]
    sample_rows: list[int]


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
    # The job's requests, their sample rows and processed tokens after the sample,
    # and whether every grammar took its sample as text (its next mask is in ``bitmask``).
    req_ids: list[int]
    sample_rows: list[int]
    counts: list[int]
    all_consumed: bool


class GrammarSeam(LogitsConstraint, Protocol):
    """What structured outputs are to the seam: a constraint that also forgets requests."""

    def drop(self, req_ids: Iterable[int]) -> None: ...


class GrammarConstraint:
    """Structured outputs as a ``LogitsConstraint``: each row's grammar, caught up with its
    output, gives the row's bitmask; after the sampler's launch, the grammars of the step's
    samples make their next masks ahead (``fill_ahead``).

    Args:
        compile_grammar: compiles a constraint that arrived without its compiled grammar.
        fill_ahead: make decoding grammars' next masks on a thread (``_start_ahead``); for CUDA,
            whose steps run while the host prepares the next. Needs the grammar extension (which
            this builds on the machine's first call): without it, masks are filled in the step.
    """

    def __init__(
        self, compile_grammar: Callable[[StructuredOutputsParams], CompiledGrammar], fill_ahead: bool = False
    ) -> None:
        self._compile_grammar = compile_grammar
        self.fill_ahead = fill_ahead and native.available()
        # req_id -> its grammar (None once its output left the grammar).
        self._grammars: dict[int, StructuredOutputGrammar | None] = {}
        self._grammar_batch: GrammarBatch | None = None  # made at the first grammar
        self._vocab_size = 0  # the logits' width, known at the first grammar
        self._pin_memory = False  # bitmasks in pinned memory: for logits on CUDA
        # Two pinned host bitmasks used in turn, each with the event after the sampler that read
        # it last (None until ``_masks_read``); the events no buffer holds now, and the stream.
        self._pinned: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._free_events: list[torch.cuda.Event] = []
        self._stream: torch.cuda.Stream | None = None
        self._ahead_worker: GrammarAheadWorker | None = None  # made at the first job
        self._ahead: _AheadJob | None = None
        # This step's masks, when all were made ahead (``_all_made_ahead``): the next job is then
        # the same grammars at the same rows.
        self._steady: _Ahead | None = None

    def drop(self, req_ids: Iterable[int]) -> None:
        for req_id in req_ids:
            self._grammars.pop(req_id, None)

    def before_sampling(self, logits: torch.Tensor, rows: ConstraintRows) -> torch.Tensor | None:
        """The rows' grammar bitmask for the sampler to apply, on the host (pinned on CUDA,
        guarded by the event ``after_launch`` records); None: no row has a grammar."""
        req_ids, params, num_output_tokens = rows.req_ids, rows.params, rows.num_output_tokens
        ahead = self._take_ahead()
        self._steady = None
        if ahead is not None and self._all_made_ahead(ahead, req_ids, params, num_output_tokens):
            self._steady = ahead
            buffer = ahead.bitmask
            bitmask = buffer[: len(req_ids)]
            if len(req_ids) > len(ahead.sample_rows):  # rows without a grammar allow everything
                unconstrained = np.ones(len(req_ids), dtype=bool)
                unconstrained[ahead.sample_rows] = False
                bitmask.numpy()[unconstrained] = -1
            return self._hand_over(bitmask, buffer)
        grammars = [
            self._grammar(req_id, params[i], i, rows.output_token_ids, num_output_tokens[i], ahead)
            for i, req_id in enumerate(req_ids)
        ]
        if all(grammar is None for grammar, _ in grammars):
            return None
        if self._grammar_batch is None:
            self._grammar_batch = GrammarBatch()
            self._vocab_size = logits.shape[1]
            self._pin_memory = logits.device.type == "cuda"
        # Rows whose mask was made ahead stay where the thread wrote them or move; the others are
        # filled now.
        ahead_rows = {i: source for i, (_, source) in enumerate(grammars) if source >= 0}
        if ahead is not None and ahead.bitmask.shape[0] >= len(grammars):
            buffer = ahead.bitmask
            moves = {i: source for i, source in ahead_rows.items() if i != source}
        else:
            buffer = self._mask_buffer(len(grammars))
            moves = ahead_rows
        if moves:
            assert ahead is not None
            moved = ahead.bitmask.numpy()[list(moves.values())]  # a copy: sources may be overwritten
        bitmask = self._grammar_batch.bitmask(
            [grammar for grammar, _ in grammars], self._vocab_size, out=buffer, skip=ahead_rows.keys()
        )
        if moves:
            bitmask.numpy()[list(moves)] = moved
        return self._hand_over(bitmask, buffer)

    def _all_made_ahead(
        self,
        ahead: _Ahead,
        req_ids: list[int],
        params: list[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> bool:
        """The steady state of decoding: every grammar row of this step was advanced ahead by its
        only new token, is at the row its sample had, and has its mask there; the step then
        needs no per-row work. (Beam search's continuations are the host's: never here.)"""
        sample_rows = ahead.sample_rows
        return (
            ahead.all_consumed
            and ahead.bitmask.shape[0] >= len(req_ids) > max(sample_rows)
            and [req_ids[row] for row in sample_rows] == ahead.req_ids
            and [num_output_tokens[row] for row in sample_rows] == ahead.counts
            and sum(p.structured_outputs is not None for p in params) == len(sample_rows)
            and not any(p.use_beam_search for p in params)
            and all(self._grammars.get(r) is g for r, g in zip(ahead.req_ids, ahead.grammars))
        )

    def _hand_over(self, bitmask: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        """The bitmask for the sampler. On CUDA it stays in its pinned ``buffer``: the sampler's
        fused pass reads it there, over the bus (196 KB for 32 rows of SmolLM2's vocabulary),
        with no copy to launch; other paths copy it. The buffer is refilled only after the event
        ``_masks_read`` records."""
        if self._pin_memory:
            self._pinned.append((buffer, None))
        return bitmask

    def after_launch(self, samples: torch.Tensor, requests: Sequence[SampledRequest]) -> None:
        self._masks_read()
        if self.fill_ahead:
            self._start_ahead(samples, requests)

    def _masks_read(self) -> None:
        """The bitmask handed to the sampler is read by the work queued so far: records an event
        after it, on the stream the worker runs its steps on (looked up once: the lookup costs
        ~10 us of Python a step)."""
        if not self._pinned or self._pinned[-1][1] is not None:
            return
        if self._stream is None:
            self._stream = torch.cuda.current_stream()
        event = self._free_events.pop() if self._free_events else torch.cuda.Event()
        event.record(self._stream)
        self._pinned[-1] = (self._pinned[-1][0], event)

    def _start_ahead(self, samples: torch.Tensor, entries: Sequence[SampledRequest]) -> None:
        """Advance the grammars of this step's samples and fill their next masks on the native
        thread.

        samples: the step's sampled ids on the host (int64), -1 until they land (a pinned buffer
        its device-to-host copy writes; or the samples themselves); entries: (req_id, output
        index, sample row) of each request with logits processors. Only a native grammar that
        stands just before its sample is advanced: one caught up by this step's processors.
        """
        self._take_ahead()  # a step without these requests' rows left it untaken
        steady, self._steady = self._steady, None
        if (
            steady is not None
            and [req_id for req_id, _, _ in entries] == steady.req_ids
            and [row for _, _, row in entries] == steady.sample_rows
        ):
            # The grammars this step found at their samples' rows, each just before its new sample
            # (checked then): the worker keeps their matchers and rows from the last job.
            req_ids, grammars, sample_rows = steady.req_ids, steady.grammars, steady.sample_rows
            bitmask = self._mask_buffer(max(sample_rows) + 1, wait=False)
            self._ahead_worker.resubmit(samples, bitmask)
            self._ahead = _AheadJob(samples, bitmask, req_ids, grammars, sample_rows)
            return
        req_ids, grammars, sample_rows = [], [], []
        for req_id, output_index, row in entries:
            grammar = self._grammars.get(req_id)
            if (
                grammar is not None
                and not grammar.is_terminated()
                and grammar.num_processed_tokens == output_index
                and grammar.is_native
            ):
                req_ids.append(req_id)
                grammars.append(grammar)
                sample_rows.append(row)
        if not grammars:
            return
        if self._ahead_worker is None:
            self._ahead_worker = GrammarAheadWorker(self._vocab_size)
        bitmask = self._mask_buffer(max(sample_rows) + 1, wait=False)
        self._ahead_worker.submit(samples, grammars, sample_rows, bitmask)
        self._ahead = _AheadJob(samples, bitmask, req_ids, grammars, sample_rows)

    def _take_ahead(self) -> _Ahead | None:
        """The masks made ahead since the last step (waits for the thread, without the GIL)."""
        if self._ahead is None:
            return None
        job, self._ahead = self._ahead, None
        result = self._ahead_worker.wait()
        if result is None:  # the step never delivered its samples
            logger.warning("the grammar masks made ahead timed out waiting for the step's samples")
            return None
        index = {req_id: i for i, req_id in enumerate(job.req_ids)}
        counts = [grammar.num_processed_tokens for grammar in job.grammars]
        return _Ahead(
            job.bitmask,
            index,
            job.grammars,
            result.token_ids,
            result.accepted,
            result.rows,
            job.req_ids,
            job.sample_rows,
            counts,
            result.all_consumed,
        )

    def _mask_buffer(self, num_rows: int, wait: bool = True) -> torch.Tensor:
        """A host bitmask of at least ``num_rows`` rows; on CUDA a pinned one whose last reader
        (the sampler of an earlier step) is done, or (``wait=False``) was queued before this
        step's sampler: the ahead thread writes it only once that step's samples have landed,
        after everything queued before them.

        The device reads pinned memory directly, and a copy from it is asynchronous; from
        pageable memory a copy would wait for the device to reach it, i.e. for the step's forward
        pass, and the host's work would stop overlapping the device's. Two buffers in turn: the
        one filled now may still be read by the step in flight.
        """
        if not self._pin_memory:
            return allocate_token_bitmask(num_rows, self._vocab_size)
        if len(self._pinned) == 2:
            buffer, event = self._pinned.pop(0)
            # No event: its step failed before the sampler; the buffer is left to the allocator.
            if event is not None:
                if wait:
                    event.synchronize()
                self._free_events.append(event)
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


class RequestLogitsProcessors:
    """The worker's side of the logits-constraint seam: the step's constraints (allowed tokens,
    logit bias, bad words, grammars) over the persistent batch's rows, and the output history
    they read (``InputBatch.append_sampled``), which grows by each step's samples of the
    requests with a constraint, once those samples are on the host.

    Args:
        input_batch: the worker's persistent batch.
        grammars: the structured outputs' constraint: the grammars themselves
            (``GrammarConstraint``), or under tensor parallelism their bitmask sent from rank 0 or
            received there (``grammar_ranks.grammar_constraint`` chooses).
    """

    def __init__(self, input_batch: InputBatch, grammars: GrammarSeam) -> None:
        self._batch = input_batch
        self.grammars = grammars
        self.constraints = LogitsConstraints([AllowedTokenIds(), LogitBias(), BadWords(), self.grammars])
        # This step's first sample of each request with a constraint (``SampledRequest``s).
        self._requests: list[SampledRequest] = []
        # The last step's such samples, not yet in their output history: (step, requests).
        self._unrecorded_samples: tuple[StepSamples, list[SampledRequest]] | None = None

    def drop(self, req_ids: Iterable[int]) -> None:
        self.grammars.drop(req_ids)

    def before_sampling(self, logits: torch.Tensor, model_input: SampleRows) -> torch.Tensor | None:
        """Apply the step's constraints to ``logits`` [num_sample_rows, vocab_size] (in place);
        returns the grammar bitmask for the sampler, or None."""
        batch = self._batch
        rows = model_input.sample_rows
        self._requests = []
        if not batch.has_processors[rows].any():
            return None
        self._record_output_history()
        row_list = rows.tolist()
        bitmask = self.constraints.before_sampling(
            logits,
            ConstraintRows(
                model_input.sample_req_ids,
                [batch.params[row] for row in row_list],
                lambda i, start: batch.output_token_ids(row_list[i], start),
                batch.num_output_tokens[rows].tolist(),
            ),
        )
        self._requests = self._first_samples(model_input)
        return bitmask

    def after_launch(self, step: StepSamples) -> None:
        """The step's sampler is launched and its samples' copy to the host queued."""
        if not self._requests:
            return
        requests, self._requests = self._requests, []
        self._unrecorded_samples = (step, requests)
        self.constraints.after_launch(step.samples_on_host(), requests)

    def _first_samples(self, model_input: SampleRows) -> list[SampledRequest]:
        """(req_id, output index, sample row) of this step's first sample of every request with a
        constraint (read before ``record_samples`` counts it)."""
        batch = self._batch
        index = np.flatnonzero(batch.has_processors[model_input.sampling_req_rows])
        rows = model_input.sampling_req_rows[index]
        return list(
            zip(
                [batch.req_ids[row] for row in rows.tolist()],
                batch.num_output_tokens[rows].tolist(),
                model_input.first_sample_index[index].tolist(),
            )
        )

    def _record_output_history(self) -> None:
        """Append the last step's samples to the output history of the requests with a
        constraint (a grammar advances over them); waits for those samples to reach the host,
        which a step already launched behind them does not delay."""
        if self._unrecorded_samples is None:
            return
        step, requests = self._unrecorded_samples
        self._unrecorded_samples = None
        token_ids = step.sampled_token_ids()
        self._batch.append_sampled((req_id, index, token_ids[row]) for req_id, index, row in requests)
