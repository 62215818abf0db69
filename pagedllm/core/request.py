"""A Request: one output sequence of a user's request, the unit the scheduler schedules; a
RequestGroup: the user's request, the unit it preempts, swaps and isolates.

A user's request with ``n``/``best_of`` > 1 or beam search has several Requests (siblings, the
members of its group) sharing its prompt and, through the KV cache manager, its prompt's blocks.
It starts as one Request that draws ``best_of`` first tokens (``num_samples``) from the prompt;
``core/fanout.py`` then forks it into ``best_of`` siblings. Beam search forks and frees siblings
every step. What the siblings share (parameters, arrival, EOS ids, what the workers need to
sample for them) is set once, on the group, when the request is added.

The scheduler schedules in tokens, not phases: each Request has ``num_computed_tokens`` (tokens
whose K/V are in the cache, or will be once the steps already sent have run) and
``num_tokens_with_placeholders`` (known tokens plus tokens sampled by steps still in flight).
Whatever lies between is computed next, a chunk at a time::

    prompt + outputs                  [p p p p p p o o o ?]     ? = a placeholder: sampled by a
    num_computed_tokens                ----------------^            step in flight, its id not
                                                                    yet seen by the host
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.step_io import NewRequestData

if TYPE_CHECKING:
    from pagedllm.lora.request import LoRARequest
    from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    # Preempted by SWAP: its blocks are in the CPU swap space.
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    # Failed by the engine: a model step it took part in raised, and raised again when it ran
    # alone (``Request.error`` holds the step's error).
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= _FIRST_FINISHED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self)


# A plain int: compared for every request several times a step, where an enum lookup costs more.
_FIRST_FINISHED = int(RequestStatus.FINISHED_STOPPED)
# The OpenAI finish reason of each finished status (read per sampled token: a dict, not a property).
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Logprob:
    """One token's log probability and, when asked for, its rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, for the chosen token and the top-k (vLLM's format).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding, over the request's sequences: drafted tokens verified, and accepted.
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted drafts over verified drafts (None before any was verified)."""
        if not self.spec_num_draft_tokens:
            return None
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


def hash_block_tokens(prev: int | tuple | None, tokens: Sequence[int]) -> int:
    """The prefix-cache key of one full block: its tokens chained with the key of the block before
    it (``prev``; for the first block, the adapter's cache salt or None), so equal keys mean equal
    prefixes. The data-parallel router keys its prefix affinity with it too."""
    return hash((prev, tuple(tokens)))


def num_candidates(beam_width: int, num_eos_token_ids: int) -> int:
    """Beam search's continuations kept per step (and offered per beam): enough that B of them
    do not end."""
    return max(2, 1 + num_eos_token_ids) * beam_width


class RequestGroup:
    """A user's request as the core sees it: its live sequences and what they share.

    The unit of preemption (its running members are preempted together), swap (swapped out and
    in together, shared blocks once) and isolation (a failure convicts the whole group).

    Args:
        first: the request's first sequence; forks join the group (``core/fanout.py``).
        request_id: the caller's id of the request.
        eos_token_ids: the tokens that end a sequence (none with ``ignore_eos``).
        lora_request: the adapter its sequences run with, or None.
    """

    def __init__(
        self,
        first: Request,
        request_id: str,
        eos_token_ids: Iterable[int],
        lora_request: LoRARequest | None = None,
    ) -> None:
        params = first.sampling_params
        self.request_id = request_id
        self.lora_request = lora_request
        # 0 without an adapter: the scheduler counts a step's distinct adapters by it.
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        self.sampling_params = params
        self.arrival_time = first.arrival_time
        # Live sequences, in the order they were created (finished ones leave).
        self.members: list[Request] = [first]
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        # Sent to the workers with each member: the tokens banned until min_tokens outputs exist,
        # and how many most likely tokens a sample returns (logprobs, beam search's candidates).
        self.min_tokens_stop_ids = (
            sorted(set(params.stop_token_ids) | self.eos_token_ids) if params.min_tokens else []
        )
        beam = num_candidates(params.best_of, len(self.eos_token_ids)) if params.use_beam_search else 0
        self.num_top_tokens = max(params.logprobs or 0, beam)
        # What the core counts of it (speculative decoding's drafts), sent to the frontend's
        # RequestMetrics when it ends.
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        # How the engine core reports its tokens (``EngineCoreRequest.reports_each_token``), and,
        # when not each as it comes, how many of its one sequence's tokens it has reported.
        self.reports_each_token = True
        self.num_reported_tokens = 0

    @property
    def max_running_seqs(self) -> int:
        """Rows the group may hold at once: best_of before its first sample forks it (and always,
        for beam search), then its live members."""
        params = self.sampling_params
        if params.use_beam_search or self.members[0].num_samples > 1:
            return params.best_of
        return len(self.members)

    def members_in(self, status: RequestStatus) -> list[Request]:
        return [member for member in self.members if member.status == status]


class Request:
    """One output sequence: its tokens, its progress through the cache, and its status.

    Args:
        req_id: the engine's own id for this sequence (unique while the engine lives; never a
            caller's id, so no caller can collide with another).
        prompt_token_ids: shared, never mutated, by every sibling.
        sampling_params: the user request's parameters.
        block_size: tokens per KV block (the unit of prefix-cache hashes).
        arrival_time: the user request's arrival: siblings share it, and FCFS orders by it.
        request_id, eos_token_ids, lora_request: the caller's id, the tokens that end a sequence
            and the adapter, for the request's group, which this first sequence creates.
    """

    def __init__(
        self,
        req_id: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        block_size: int,
        arrival_time: float | None = None,
        request_id: str = "",
        eos_token_ids: Iterable[int] = (),
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.block_size = block_size
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Tokens sampled by steps in flight whose ids the host has not seen yet (async scheduling).
        self.num_output_placeholders = 0
        self.status = RequestStatus.WAITING
        # Rows drawn from the prompt's last position on the first sample: best_of until the
        # request forks, then 1 (beam search draws its candidates from one row per beam).
        self.num_samples = 1
        self.group = RequestGroup(self, request_id, eos_token_ids, lora_request)
        # Prefix-cache keys of the full blocks of known tokens, computed as blocks fill.
        self.block_hashes: list[int] = []
        self.cumulative_logprob = 0.0
        self.first_scheduled_time: float | None = None
        # Why the scheduler ended it early (it can never fit in the cache, or it fails the model
        # step), if it did.
        self.error: str | None = None
        # Beam search needs the host after every sample (read once a step): the engine chooses
        # the continuations. (A grammar or bad words need the output history too, but on the
        # worker, which keeps it from its own samples: no wait for the host.)
        self._host_after_each_sample = sampling_params.use_beam_search
        # Set when the request must be resent in full to the workers (new, resumed, forked, or
        # its next token chosen on the host rather than by the worker's sampler).
        self.resend = True
        # Its place among the user request's outputs (set by the fan-out for forks).
        self.output_index = 0
        # The stop token id that ended it, if one did.
        self.stop_reason: int | None = None

    # --- tokens -----------------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders

    def get_token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def seed(self) -> int | None:
        """The seed of this sequence's generator: the user's for the first output, a distinct one
        derived from it (hash of the pair) for each sibling (None: the global generator)."""
        seed = self.sampling_params.seed
        if seed is None or self.output_index == 0:
            return seed
        return hash((seed, self.output_index)) & (2**63 - 1)

    def get_last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def append_output_token(self, token_id: int, logprob: float) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def update_block_hashes(self) -> list[int]:
        """The prefix-cache key of every full block of known tokens: a hash of the block's tokens
        chained with the key of the block before it, so equal keys mean equal prefixes. The first
        block chains from the request's adapter: K/V under two adapters differ, never shared."""
        hashes = self.block_hashes
        block_size = self.block_size
        lora_request = self.group.lora_request
        first = None if lora_request is None else lora_request.cache_salt
        for index in range(len(hashes), self.num_tokens // block_size):
            prev = hashes[-1] if hashes else first
            tokens = self.get_token_ids_slice(index * block_size, (index + 1) * block_size)
            hashes.append(hash_block_tokens(prev, tokens))
        return hashes

    # --- progress ---------------------------------------------------------------------------

    @property
    def num_uncomputed_tokens(self) -> int:
        # Read several times per request and step: spelled out rather than built on the others.
        return (
            len(self.prompt_token_ids)
            + len(self.output_token_ids)
            + self.num_output_placeholders
            - self.num_computed_tokens
        )

    @property
    def is_finished(self) -> bool:
        return self.status >= _FIRST_FINISHED

    @property
    def needs_host_between_steps(self) -> bool:
        """Whether its next step depends on the host seeing this step's token first: the fork
        after a best_of request's first sample, and beam search's choice of continuations."""
        return self.num_samples > 1 or self._host_after_each_sample

    def fork(self, req_id: int) -> Request:
        """A copy with the same tokens, progress and group (``core/fanout.py`` makes it a member
        and shares its blocks). Output-side state is copied; the engine sets its index."""
        child = Request.__new__(Request)
        child.__dict__.update(self.__dict__)
        child.req_id = req_id
        child.output_token_ids = self.output_token_ids.copy()
        child.block_hashes = self.block_hashes.copy()
        child.resend = True
        return child

    def __repr__(self) -> str:
        return (
            f"Request(req_id={self.req_id}, status={self.status.name}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )


def priority(request: Request) -> tuple[float, int]:
    """FCFS: the earlier user request first, then the earlier sequence."""
    return request.arrival_time, request.req_id


def new_request_data(request: Request, block_ids: list[int], state_slot: int = -1) -> NewRequestData:
    """The request in full, for workers that hold no row for it."""
    group = request.group
    return NewRequestData(
        req_id=request.req_id,
        seed=request.seed,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=request.output_token_ids.copy(),
        sampling_params=request.sampling_params,
        block_ids=block_ids.copy(),
        num_computed_tokens=request.num_computed_tokens,
        num_samples=request.num_samples,
        min_tokens_stop_ids=group.min_tokens_stop_ids,
        num_top_tokens=group.num_top_tokens,
        lora_request=group.lora_request,
        state_slot=state_slot,
    )


@dataclass
class PendingHypothesis:
    """A beam search hypothesis chosen by a step, before it is built: the beam it extends, by
    ``token_id``, and how it ends."""

    parent: Request
    token_id: int
    logprob: float
    status: RequestStatus


@dataclass
class BeamSearchState:
    """A beam search request's state between steps (``engine/beam_search.py`` decides with it)."""

    beam_width: int
    # Kept hypotheses, best score first, at most B: finished sequences holding no blocks, or,
    # until the engine builds them right after the step, pending ones.
    finished: list[tuple[float, Request | PendingHypothesis]] = field(default_factory=list)
    # Running score of each live beam (its cumulative logprob, or penalised: see beam_search.py).
    beam_scores: dict[int, float] = field(default_factory=dict)
    improvement_possible: bool = True
