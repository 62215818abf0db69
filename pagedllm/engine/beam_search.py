"""Beam search over a request's sequences, step by step, as Hugging Face ``generate`` does it.

A request with ``use_beam_search`` keeps ``B = best_of`` live sequences (beams). Each step, every
beam offers its ``K = 2B`` most likely next tokens (``K = (1 + #EOS) * B`` with more EOS ids);
the K best continuations over all beams by cumulative logprob are kept:

- a continuation that ends the sequence (EOS, a stop token, max_tokens, the context limit) and
  ranks among the first B becomes a finished hypothesis, scored
  ``cumulative_logprob / generated_len ** length_penalty``; the B best hypotheses are kept;
- the B best continuations that do not end become the next beams. A beam that several
  continuations extend is forked (the forks share its blocks, copy-on-write); a beam that none
  extends is freed. The core's fan-out does both (``core/fanout.py``): this module only
  decides.

Search stops when no live beam can still beat the worst kept hypothesis (HF's heuristic, with
``early_stopping`` True / False / "never" as in ``generate``), when every candidate ends, or, with
``early_stopping=True``, as soon as B hypotheses are kept. The outputs are the ``n`` best
hypotheses. Scores follow transformers' vectorised implementation step for step, so outputs
match ``generate(num_beams=B, length_penalty=..., early_stopping=...)`` token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.core.request import BeamSearchState, PendingHypothesis, Request, RequestStatus, num_candidates
from pagedllm.sampling_params import SamplingParams

# HF's stand-in for "impossible": added to scores that must never be picked.
_NEG = -1.0e9


@dataclass
class Candidate:
    score: float
    parent: Request
    token_id: int
    logprob: float
    ends: RequestStatus | None = None


@dataclass
class BeamStep:
    """One step's decision for a request's beams.

    Attributes:
        extensions: beam req_id -> the (token, logprob) continuations it keeps, best first (a
            beam absent here is dropped).
        scores: the running score of each kept continuation, in the order of ``extensions``.
        done: the search is over: the outputs are the kept hypotheses.
    """

    extensions: dict[int, list[tuple[int, float]]]
    scores: list[float]
    done: bool


def beam_search_step(
    state: BeamSearchState,
    params: SamplingParams,
    beams: list[tuple[Request, list[int], list[float]]],
    ends: Callable[[Request, int], RequestStatus | None],
    num_eos_token_ids: int,
    max_new_tokens: int,
) -> BeamStep:
    """Choose one step's continuations.

    Args:
        beams: each live beam with its most likely next tokens and their logprobs.
        ends: the status a beam would finish with if the token came next, or None.
        max_new_tokens: the most tokens any beam can reach (max_tokens, or the context left).
    """
    width = state.beam_width
    k = num_candidates(width, num_eos_token_ids)
    candidates = []
    for parent, top_ids, top_logprobs in beams:
        base = state.beam_scores.get(parent.req_id, 0.0)
        for token_id, logprob in zip(top_ids, top_logprobs):
            candidates.append(Candidate(base + logprob, parent, token_id, logprob))
    # A stable sort: among equal scores the earlier beam and the likelier token come first.
    candidates = sorted(candidates, key=lambda c: c.score, reverse=True)[:k]
    for candidate in candidates:
        candidate.ends = ends(candidate.parent, candidate.token_id)

    generated_len = candidates[0].parent.num_output_tokens + 1
    _keep_finished(state, candidates[:width], generated_len, params)
    next_beams = sorted(
        candidates, key=lambda c: c.score + (_NEG if c.ends is not None else 0.0), reverse=True
    )[:width]
    extensions: dict[int, list[tuple[int, float]]] = {}
    scores_by_beam: dict[int, list[float]] = {}
    for candidate in next_beams:
        extensions.setdefault(candidate.parent.req_id, []).append((candidate.token_id, candidate.logprob))
        score = candidate.score + (_NEG if candidate.ends is not None else 0.0)
        scores_by_beam.setdefault(candidate.parent.req_id, []).append(score)
    # Scores in the order the scheduler creates the live beams: by parent, then continuation.
    scores = [score for parent, _, _ in beams for score in scores_by_beam.get(parent.req_id, [])]

    best_running = max(scores)
    if params.early_stopping == "never" and params.length_penalty > 0.0:
        best_len = max_new_tokens
    else:
        best_len = generated_len
    worst_finished = state.finished[-1][0] if len(state.finished) == width else _NEG
    state.improvement_possible = state.improvement_possible and (
        best_running / best_len**params.length_penalty > worst_finished
    )
    full = len(state.finished) == width and params.early_stopping is True
    done = not state.improvement_possible or full or all(c.ends is not None for c in candidates)
    return BeamStep(extensions, scores, done)


def _keep_finished(
    state: BeamSearchState, top_candidates: list[Candidate], generated_len: int, params: SamplingParams
) -> None:
    """Keep the top candidates that end as scored hypotheses (the best B, best first)."""
    if not state.improvement_possible:
        return
    if len(state.finished) == state.beam_width and params.early_stopping is True:
        return
    for c in top_candidates:
        if c.ends is not None:
            hypothesis = PendingHypothesis(c.parent, c.token_id, c.logprob, c.ends)
            state.finished.append((c.score / generated_len**params.length_penalty, hypothesis))
    state.finished.sort(key=lambda item: item[0], reverse=True)
    del state.finished[state.beam_width :]
