"""Beam search over a request's sequences, step by step, as Hugging Face ``generate`` does it.

A request with ``use_beam_search`` keeps ``B = best_of`` live sequences (beams). Each step, every
beam offers its ``K = 2B`` most likely next tokens (``K = (1 + #EOS) * B`` with more EOS ids);
the K best continuations over all beams by cumulative logprob are kept:

- a continuation that ends the sequence (EOS, a stop token, max_tokens, the context limit) and
  ranks among the first B becomes a finished hypothesis, scored
  ``cumulative_logprob / generated_len ** length_penalty``; the B best hypotheses are kept;
- the B best continuations that do not end become the next beams. A beam that several
  continuations extend is forked (the forks share its blocks, copy-on-write); a beam that none
  extends is freed.

Search stops when no live beam can still beat the worst kept hypothesis (HF's heuristic, with
``early_stopping`` True / False / "never" as in ``generate``), when every candidate ends, or, with
``early_stopping=True``, as soon as B hypotheses are kept. The outputs are the ``n`` best
hypotheses. Scores follow transformers' vectorised implementation step for step, so outputs
match ``generate(num_beams=B, length_penalty=..., early_stopping=...)`` token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.layers.sampler import SequenceSample
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

# HF's stand-in for "impossible": added to scores that must never be picked.
_NEG = -1.0e9


@dataclass
class BeamSearchState:
    """A beam search request's state between steps (on its SequenceGroup)."""

    beam_width: int
    # Kept hypotheses: finished sequences (not holding blocks), best score first, at most B.
    finished: list[tuple[float, Sequence]] = field(default_factory=list)
    # Running score of each live beam (its cumulative logprob, or _NEG-penalised: see step()).
    beam_scores: dict[int, float] = field(default_factory=dict)
    improvement_possible: bool = True


@dataclass
class Candidate:
    score: float
    parent: Sequence
    token_id: int
    logprob: float
    ends: bool = False


def num_candidates(beam_width: int, num_eos_token_ids: int) -> int:
    """Continuations kept per step (and offered per beam): enough that B of them do not end."""
    return max(2, 1 + num_eos_token_ids) * beam_width


class BeamSearch:
    """Applies one step's candidates to a beam search request.

    Args (callbacks into the engine; each gets the request first):
        fork: adds to the request a child of a live beam that shares its blocks.
        free: releases a live beam's blocks.
        new_seq_id: a fresh sequence id (for finished hypotheses, which hold no blocks).
        ends: the status a sequence would finish with if ``token_id`` were appended, or None.
        append: appends a sampled token to a sequence (and detokenizes it).
    """

    def __init__(
        self,
        fork: Callable[[SequenceGroup, Sequence], Sequence],
        free: Callable[[Sequence], None],
        new_seq_id: Callable[[], int],
        ends: Callable[[SequenceGroup, Sequence, int], SequenceStatus | None],
        append: Callable[[SequenceGroup, Sequence, SequenceSample], object],
    ) -> None:
        self._fork = fork
        self._free = free
        self._new_seq_id = new_seq_id
        self._ends = ends
        self._append = append

    def step(
        self,
        seq_group: SequenceGroup,
        samples: list[SequenceSample],
        num_eos_token_ids: int,
        max_new_tokens: int,
    ) -> None:
        """Apply one step. samples: one per live beam, with its top tokens (``top_token_ids`` and
        ``top_logprobs``); max_new_tokens: the most tokens any beam can reach (max_tokens, or the
        context left)."""
        state = seq_group.beam_state
        assert state is not None
        params = seq_group.sampling_params
        width = state.beam_width
        k = num_candidates(width, num_eos_token_ids)
        seqs_by_id = {seq.seq_id: seq for seq in seq_group.get_unfinished_seqs()}
        candidates = []
        for sample in samples:
            parent = seqs_by_id[sample.parent_seq_id]
            base = state.beam_scores.get(parent.seq_id, 0.0)
            for token_id, logprob in zip(sample.top_token_ids, sample.top_logprobs):
                candidates.append(Candidate(base + logprob, parent, token_id, logprob))
        # A stable sort: among equal scores the earlier beam and the likelier token come first.
        candidates = sorted(candidates, key=lambda c: c.score, reverse=True)[:k]
        for candidate in candidates:
            candidate.ends = self._ends(seq_group, candidate.parent, candidate.token_id) is not None

        generated_len = candidates[0].parent.num_output_tokens + 1
        self._keep_finished(seq_group, state, candidates[:width], generated_len, params)
        next_beams = sorted(candidates, key=lambda c: c.score + (_NEG if c.ends else 0.0), reverse=True)[
            :width
        ]
        self._advance_beams(seq_group, state, next_beams)

        best_running = max(state.beam_scores.values())
        if params.early_stopping == "never" and params.length_penalty > 0.0:
            best_len = max_new_tokens
        else:
            best_len = generated_len
        worst_finished = state.finished[-1][0] if len(state.finished) == width else _NEG
        state.improvement_possible = state.improvement_possible and (
            best_running / best_len**params.length_penalty > worst_finished
        )
        full = len(state.finished) == width and params.early_stopping is True
        if not state.improvement_possible or full or all(c.ends for c in candidates):
            self._finish(seq_group, state)

    def _keep_finished(
        self,
        seq_group: SequenceGroup,
        state: BeamSearchState,
        top_candidates: list[Candidate],
        generated_len: int,
        params: SamplingParams,
    ) -> None:
        if not state.improvement_possible:
            return
        if len(state.finished) == state.beam_width and params.early_stopping is True:
            return
        for candidate in top_candidates:
            if not candidate.ends:
                continue
            status = self._ends(seq_group, candidate.parent, candidate.token_id)
            hypothesis = candidate.parent.fork(self._new_seq_id())
            sample = SequenceSample(hypothesis.seq_id, candidate.token_id, candidate.logprob)
            self._append(seq_group, hypothesis, sample)
            hypothesis.status = status
            score = candidate.score / generated_len**params.length_penalty
            state.finished.append((score, hypothesis))
        state.finished.sort(key=lambda item: item[0], reverse=True)
        del state.finished[state.beam_width :]

    def _advance_beams(
        self, seq_group: SequenceGroup, state: BeamSearchState, next_beams: list[Candidate]
    ) -> None:
        children: dict[int, list[Candidate]] = {}
        for candidate in next_beams:
            children.setdefault(candidate.parent.seq_id, []).append(candidate)
        live = []
        scores = {}
        for parent in seq_group.get_unfinished_seqs():
            extensions = children.get(parent.seq_id, [])
            if not extensions:
                self._free(parent)
                continue
            # Forks first: each copies the parent before the parent takes its own token.
            beams = [parent] + [self._fork(seq_group, parent) for _ in extensions[1:]]
            for beam, candidate in zip(beams, extensions):
                self._append(
                    seq_group, beam, SequenceSample(beam.seq_id, candidate.token_id, candidate.logprob)
                )
                scores[beam.seq_id] = candidate.score + (_NEG if candidate.ends else 0.0)
                live.append(beam)
        seq_group.seqs = live
        state.beam_scores = scores

    def _finish(self, seq_group: SequenceGroup, state: BeamSearchState) -> None:
        for seq in seq_group.get_unfinished_seqs():
            self._free(seq)
        hypotheses = [seq for _, seq in state.finished]
        for index, seq in enumerate(hypotheses):
            seq.output_index = index
        seq_group.seqs = hypotheses
