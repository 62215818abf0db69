"""Speculative decoding, the scheduler's side: which requests get drafts this step, where the
drafts come from (a ``Drafter``, chosen once from the method: the n-gram lookup on the host, or
the draft model's proposals the worker sent with the previous step's samples), and the acceptance
counters.

As in vLLM v1, a request's draft tokens are just more tokens to compute: a decoding request with
``k`` drafts is scheduled ``1 + k`` tokens (its newest sample, then the drafts), its
``num_computed_tokens`` advances by all of them, and the step's message carries the drafts
(``SchedulerOutput.scheduled_spec_decode_tokens``). The worker verifies them in the same forward
pass (one row per scheduled token) and returns the drafts it accepted and one token more;
``rollback`` then takes back the rejected tokens' progress and the blocks that held only them::

    tokens      [p p p p o o o]  d d d        3 drafts scheduled after the newest output o
    computed    ----------^ +1+3             (num_computed_tokens runs through the drafts)
    after       [p p p p o o o d d x]         2 accepted, x sampled from the target
    computed    ----------------^             (one rejected draft rolled back)

Drafts never enter a request's tokens before they are accepted, so the prefix cache, whose keys
are the request's known tokens, registers only accepted ones.

Requests whose next token depends on more than the target's logits get no drafts and decode one
token at a time in the same steps: beam search (the host picks continuations), a best_of request
before it forks, and structured outputs and bad words (their masks depend on the tokens before,
so each draft position would need its own grammar state). Stop strings are matched by the frontend
token by token: one completed inside a verified run ends the sequence there, and the frontend
drops the run's later tokens.

With asynchronous scheduling the next step is scheduled before this one's verification reaches
the host: ``describe_step`` counts the drafts as accepted (placeholders up to one past the
computed tokens), the drafts of the next step are placeholders for the worker's proposals
(``WorkerProposals``), and ``apply_verification`` takes back the rejected ones when the output
arrives; near a length limit the core waits instead (``waits_for_acceptance``). docs/spec_decode.md
draws the flow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.step_budget import StepBudget
from pagedllm.spec_config import MODEL_METHODS, SpeculativeConfig
from pagedllm.step_io import DRAFT_PLACEHOLDER, ModelRunnerOutput, SchedulerOutput


@dataclass
class SpecDecodingStats:
    """Engine-wide counters since start, named as vLLM's ``spec_decode_*`` metrics."""

    num_drafts: int  # verifications (a request's drafts in one step)
    num_draft_tokens: int
    num_accepted_tokens: int
    # Per draft position i: drafts accepted there (only after every position before it).
    num_accepted_tokens_per_pos: list[int]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification: the accepted drafts and the one sampled after them."""
        return 1.0 + self.num_accepted_tokens / max(self.num_drafts, 1)


class Drafter(Protocol):
    """Where a decoding request's drafts come from."""

    def draft(self, request: Request, num_tokens: int) -> list[int]:
        """At most ``num_tokens`` drafts to follow the request's newest token."""
        ...

    def receive(self, output: ModelRunnerOutput) -> None:
        """A step's samples, applied (the worker's proposals travel with them)."""
        ...

    def scheduled(self, drafting: bool) -> None:
        """A step was scheduled, its batch drafted for or not (``SchedulerOutput.drafting``)."""
        ...


class NgramProposer:
    """Prompt lookup (Saxena, 2023; vLLM's ``ngram`` method): find the request's last n tokens
    earlier in its prompt + output, for the largest n in [prompt_lookup_min, prompt_lookup_max]
    that occurs, and draft the tokens that followed the latest such occurrence."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        # Each drafting request's tokens as one array, extended by its new outputs: building it
        # from the token lists every step cost about 20 us a request at a thousand tokens, ten
        # times the lookup (a step of 64 requests: over a millisecond of host time the GPU waits
        # for). Kept for the requests drafted since the last step's samples (``receive``).
        self._tokens: dict[int, _TokenArray] = {}
        self._drafted: set[int] = set()

    def propose(self, token_ids: np.ndarray, num_tokens: int) -> list[int]:
        """token_ids: [L] int64, the request's prompt + output. Returns at most ``num_tokens``
        drafts (none when no n-gram of the allowed sizes recurs)."""
        length = len(token_ids)
        if num_tokens <= 0 or length <= self.min_n:
            return []
        # Candidate ends of a match: earlier positions holding the last token, that have a token
        # after them to draft.
        ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
        if not len(ends):
            return []
        # Grow every candidate's match backwards one token at a time, up to max_n.
        match_len = np.ones(len(ends), dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for offset in range(1, min(self.max_n, length - 1)):
            starts = ends - offset
            alive &= starts >= 0
            alive[alive] &= token_ids[starts[alive]] == token_ids[length - 1 - offset]
            if not alive.any():
                break
            match_len += alive
        best = int(match_len.max())
        if best < self.min_n:
            return []
        end = int(ends[np.flatnonzero(match_len == best)[-1]])  # the latest of the longest
        return token_ids[end + 1 : end + 1 + num_tokens].tolist()

    def draft(self, request: Request, num_tokens: int) -> list[int]:
        entry = self._tokens.get(request.req_id)
        if entry is None or entry.request is not request:
            entry = self._tokens[request.req_id] = _TokenArray(request)
        self._drafted.add(request.req_id)
        return self.propose(entry.extended(), num_tokens)

    def receive(self, output: ModelRunnerOutput) -> None:
        # Drafts come from the tokens alone; the arrays of requests not drafted for in the step
        # (finished, preempted, past disable_by_batch_size) are dropped, to be rebuilt if needed.
        self._tokens = {req_id: self._tokens[req_id] for req_id in self._drafted if req_id in self._tokens}
        self._drafted = set()

    def scheduled(self, drafting: bool) -> None:
        pass  # drafts come from the host's tokens whenever asked


class _TokenArray:
    """A request's prompt + output tokens as one int64 array that grows with its outputs (the
    host's tokens only ever grow: rejected drafts never reach ``output_token_ids``)."""

    def __init__(self, request: Request) -> None:
        self.request = request
        num_prompt = len(request.prompt_token_ids)
        self.array = np.empty(2 * request.num_tokens + 64, dtype=np.int64)
        self.array[:num_prompt] = request.prompt_token_ids
        self.length = num_prompt

    def extended(self) -> np.ndarray:
        """The request's tokens now: the outputs since the last call appended (capacity doubled
        when they do not fit)."""
        request = self.request
        num_tokens = request.num_tokens
        if num_tokens > self.length:
            if num_tokens > len(self.array):
                self.array = np.concatenate([self.array[: self.length], np.empty(2 * num_tokens, np.int64)])
            num_prompt = len(request.prompt_token_ids)
            self.array[self.length : num_tokens] = request.output_token_ids[self.length - num_prompt :]
            self.length = num_tokens
        return self.array[:num_tokens]


class WorkerProposals:
    """The worker's proposals (``draft_model``, ``eagle``, ``eagle3``; worker/draft_model.py,
    worker/eagle.py): the worker drafts ``k`` tokens after every sample it draws and keeps them on
    the device, where the next verification of the request reads them; the scheduler schedules
    placeholders (``DRAFT_PLACEHOLDER``) for them. A request has them when its newest token was
    sampled in the step in flight (asynchronous scheduling: that step's output, and the drafts'
    ids, are still on their way) and that step's batch was drafted for (the n-gram lookup makes no
    proposals after a step past ``disable_by_batch_size``), or in the step just applied. A request
    the worker did not draft for (a sibling forked after its first token, a request swapped in)
    decodes one token meanwhile."""

    def __init__(self) -> None:
        self.proposals: dict[int, list[int]] = {}
        self._in_flight_drafted = True

    def draft(self, request: Request, num_tokens: int) -> list[int]:
        in_flight = request.num_output_placeholders and self._in_flight_drafted
        if in_flight or request.req_id in self.proposals:
            return [DRAFT_PLACEHOLDER] * num_tokens
        return []

    def receive(self, output: ModelRunnerOutput) -> None:
        self.proposals = output.draft_token_ids

    def scheduled(self, drafting: bool) -> None:
        self._in_flight_drafted = drafting


def can_speculate(request: Request) -> bool:
    """Whether drafts for the request can be verified from the target's logits alone (see the
    module docstring for those that cannot)."""
    params = request.sampling_params
    return not (request.needs_host_between_steps or params.structured_outputs or params.bad_words_token_ids)


def max_num_drafts(request: Request, num_speculative_tokens: int, max_context_len: int | None) -> int:
    """Drafts the request may verify this step: ``num_speculative_tokens`` cut so that the drafts
    and the token sampled after them fit under ``max_tokens`` and the context (a decoding request:
    its one uncomputed token is its newest sample). Tokens in flight count as accepted: the cut
    never passes the limits, and is exact once they are known (``waits_for_acceptance``)."""
    num = num_speculative_tokens
    max_tokens = request.sampling_params.max_tokens
    num_tokens = request.num_tokens_with_placeholders
    if max_tokens is not None:
        num = min(num, max_tokens - (num_tokens - request.num_prompt_tokens) - 1)
    if max_context_len is not None:
        num = min(num, max_context_len - num_tokens - 1)
    return max(num, 0)


class SpecDecoding:
    """The scheduler's drafter and acceptance counters (vLLM's ``spec_decode_*`` metrics).

    Args:
        config: the engine's speculative config.
        max_context_len: the most tokens a request may hold (None with attention sinks).
    """

    def __init__(
        self, config: SpeculativeConfig, max_context_len: int | None, ngram_on_worker: bool = False
    ) -> None:
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_context_len = max_context_len
        # A draft model's or an EAGLE head's drafts come from the worker, and n-gram ones too with
        # asynchronous scheduling (``ngram_on_worker``: EngineConfig.drafts_on_worker); else n-gram
        # ones from here.
        on_worker = ngram_on_worker or config.method in MODEL_METHODS
        self.drafter: Drafter = WorkerProposals() if on_worker else NgramProposer(config)
        # Engine-wide, since start: drafts verified, drafts accepted, and per draft position i the
        # drafts accepted there (position i is accepted only when every one before it was).
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * config.num_speculative_tokens

    def is_enabled_for(self, num_running: int) -> bool:
        """Drafts pay off while the step is bound by reading the weights; past
        ``disable_by_batch_size`` running requests, verifying them costs more than it saves."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running < limit

    def waits_for_acceptance(self, request: Request) -> bool:
        """Whether the request's next drafts depend on how many of those in flight are accepted
        (asynchronous scheduling): near max_tokens or the context their number does, and the
        engine applies the step in flight first, so that every step drafts what a synchronous
        one would (same tokens, same acceptance counters, same seeded draws)."""
        return (
            request.num_output_placeholders > 1  # drafts in flight besides the sample
            and can_speculate(request)
            and max_num_drafts(request, self.num_speculative_tokens, self.max_context_len)
            < self.num_speculative_tokens
        )

    def propose(self, request: Request) -> list[int]:
        """Drafts for a decoding request (all of its tokens known to the host)."""
        if not can_speculate(request):
            return []
        num = max_num_drafts(request, self.num_speculative_tokens, self.max_context_len)
        if num <= 0:
            return []
        drafts = self.drafter.draft(request, num)
        if self.config.synthetic_acceptance_rate is not None:
            # Benchmarks: always k drafts, so that the cost of verifying them is measured
            # whatever the (dummy) weights generate; which tokens they are does not matter.
            last = (request.output_token_ids or request.prompt_token_ids)[-1]
            drafts = drafts + [last] * (num - len(drafts))
        return drafts

    def schedule_drafts(
        self,
        decodes: list[Request],
        drafts: dict[int, list[int]],
        budget: StepBudget,
        out: SchedulerOutput,
        kv: KVCacheManager,
    ) -> None:
        """Schedule the drafts of the step's decodes after their own tokens, in priority order, as
        far as the token budget goes (cut drafts give back the blocks only they needed)."""
        num_scheduled_tokens = out.num_scheduled_tokens
        for request in decodes:
            request_drafts = drafts.get(request.req_id)
            if not request_drafts:
                continue
            del request_drafts[max(budget.remaining_tokens, 0) :]
            num_drafts = len(request_drafts)
            kv.free_tail(request, request.num_computed_tokens + 1 + num_drafts)
            if not num_drafts:
                continue
            out.scheduled_spec_decode_tokens[request.req_id] = request_drafts
            num_scheduled_tokens[request.req_id] += num_drafts
            budget.num_batched_tokens += num_drafts

    def apply_verification(
        self,
        request: Request,
        drafts: list[int],
        row: int,
        output: ModelRunnerOutput,
        appended: list[tuple[Request, int]],
        stop_if_ends: Callable[[Request, int], bool],
        kv: KVCacheManager,
    ) -> tuple[int, int]:
        """Apply a verification of ``drafts``: its rows from ``row`` on are the accepted drafts and
        one token more. Take back the rejected drafts' progress and the blocks only they used,
        then append the tokens up to the first that stops the request. Returns the next row and
        the tokens generated.

        The request's placeholders counted every draft as accepted (``describe_step``); a step
        scheduled since (asynchronous scheduling) computes from there, and its tokens sit
        ``rejected`` positions earlier than scheduled: the worker moved them back, and the
        request keeps the blocks they use. A request preempted by recomputation meanwhile has
        no progress to take back."""
        num_accepted = output.num_accepted_tokens[request.req_id]
        num_rejected = len(drafts) - num_accepted
        self.record(request, len(drafts), num_accepted)
        request.num_output_placeholders -= len(drafts)
        if request.num_computed_tokens:
            request.num_computed_tokens -= num_rejected
        token_ids, logprobs = output.sampled_token_ids, output.logprobs
        end = row + num_accepted + 1
        for index in range(row, end):
            token_id = token_ids[index]
            request.append_output_token(token_id, logprobs[index])
            appended.append((request, index))
            if stop_if_ends(request, token_id):
                return end, num_accepted + 1  # the tokens after it are dropped
        if request.num_computed_tokens:
            kv.free_tail(request, max(request.num_computed_tokens, request.num_tokens))
        return end, num_accepted + 1

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Count one verification: per user request (``RequestMetrics``) and engine-wide."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1
        metrics = request.group.metrics
        metrics.spec_num_draft_tokens += num_drafts
        metrics.spec_num_accepted_tokens += num_accepted

    def stats(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )
