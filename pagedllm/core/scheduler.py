"""Continuous batching: who runs in the next step, under a token budget, and what a step's samples
do to the requests.

There is no prefill phase and no decode phase. Each request has ``num_computed_tokens`` and a
length (its known tokens plus those sampled by steps still in flight); a step computes some of
the tokens in between for some requests, at most ``max_num_batched_tokens`` in all. A request
whose only uncomputed token is its newest sample is *decoding*; anything more is a *prefill* (a
new prompt, the rest of a chunked prompt, or prompt + outputs recomputed after preemption). One
step mixes both.

``schedule()`` decides, in this order:

1. Running requests, highest priority (earliest arrival, FCFS) first. A decoding request needs a
   slot for its next token; when the cache cannot give one, the lowest-priority running request
   is preempted (the request itself when none is left), with the running members of its group:
   RECOMPUTE (free its blocks, back to the front of the waiting queue) when it runs alone, SWAP
   (the group's blocks to the CPU space, shared blocks once) when not. Decodes come before
   prefill chunks, so a long prompt never stalls them.
2. Swapped groups come back, FCFS, unless this step swapped any out.
3. Waiting requests are admitted, FCFS, only when no group is swapped out: swapped groups hold
   CPU memory and come back first.

It advances ``num_computed_tokens`` at once, and a request that will sample gets a placeholder
for its token: with asynchronous scheduling the next step is scheduled before this one's samples
reach the host, and the worker feeds the placeholder from the device.

``update_from_output()`` applies a step's samples: appends tokens, has the fan-out fork a
best_of request after its first sample (``core/fanout.py``, which beam search's driver uses too),
registers computed blocks in the prefix cache. Only the core changes a request's progress or
blocks; the engine reads requests and asks the scheduler to finish them.

Isolation (``isolate_failure()``): when a model step raises, the engine drops it (and the step in
flight with it) and the scheduler looks for the group responsible, so that only that one fails.
Every request the dropped steps computed becomes a suspect and is preempted by RECOMPUTE (it
keeps its tokens; the samples in flight are gone); the isolation policy (``core/isolation.py``)
then says which requests may run, until one group is convicted or all are cleared.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_pool import Device
from pagedllm.core.fanout import FanOut
from pagedllm.core.isolation import IsolationPolicy
from pagedllm.core.kv_cache_manager import AllocStatus, KVCacheManager
from pagedllm.core.request import Request, RequestGroup, RequestStatus
from pagedllm.step_io import (
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


class PreemptionMode(enum.Enum):
    RECOMPUTE = enum.auto()
    SWAP = enum.auto()


@dataclass
class SampledRequests:
    """What ``update_from_output`` did: which requests gained tokens (with the output row of each
    token, for its logprobs), which were forked into being, and the beam search requests whose
    candidates the engine must choose from (their rows; nothing was appended to them)."""

    # (request, row) per appended token; a forked request's first token is in here too.
    appended: list[tuple[Request, int]] = field(default_factory=list)
    forked: list[tuple[Request, Request]] = field(default_factory=list)
    beams: list[tuple[Request, int]] = field(default_factory=list)


class _Budget:
    """What is left of this step's token and sequence limits."""

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.token_budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.num_batched_tokens = 0
        self.num_seqs = 0

    @property
    def remaining_tokens(self) -> int:
        return self.token_budget - self.num_batched_tokens

    def can_add_seqs(self, num_seqs: int) -> bool:
        return self.num_seqs + num_seqs <= self.max_num_seqs


def _priority(request: Request) -> tuple[float, int]:
    return request.arrival_time, request.req_id


def sibling_seed(seed: int | None, output_index: int) -> int | None:
    """The seed of the generator of a request's ``output_index``-th sequence: the user's seed for
    the first, a distinct one derived from it (hash of the pair) for each sibling."""
    if seed is None or output_index == 0:
        return seed
    return hash((seed, output_index)) & (2**63 - 1)


class Scheduler:
    """Owns the waiting, running and swapped queues and the KV cache manager.

    Args:
        scheduler_config: the token and sequence budgets, chunked prefill.
        block_size, num_gpu_blocks, num_cpu_blocks, enable_prefix_caching: the KV cache.
        sliding_window, num_sink_tokens: the window every layer attends through (None: some layer
            is global) and the attention sinks kept beside it; blocks behind the window are freed
            and, with sinks, a request's length is not bounded by max_model_len.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        enable_prefix_caching: bool = False,
        sliding_window: int | None = None,
        num_sink_tokens: int = 0,
    ) -> None:
        self.config = scheduler_config
        self.kv_cache_manager = KVCacheManager(
            block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
            sliding_window=sliding_window,
            num_sink_tokens=num_sink_tokens,
            max_blocks_per_request=-(-scheduler_config.max_model_len // block_size),
        )
        self.max_context_len = None if num_sink_tokens else scheduler_config.max_model_len
        self.block_size = block_size
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Whether ``running`` is in priority order (requests join it out of order only rarely).
        self._running_sorted = True
        # Groups whose running members were swapped out together (they come back together).
        self.swapped: deque[RequestGroup] = deque()
        self._req_ids = itertools.count()
        # Reported to the workers by the next SchedulerOutput.
        self._finished_req_ids: set[int] = set()
        self._preempted_req_ids: set[int] = set()
        # Requests the scheduler ended without running them to their end (``Request.error`` says
        # why), until the engine takes them.
        self.stopped: list[Request] = []
        self.fanout = FanOut(self.kv_cache_manager, self.new_req_id, self._add_forked, self.finish_requests)
        # Which requests may run while the suspects of failed steps are tested.
        self.isolation = IsolationPolicy()
        # Requests preempted by the last schedule() and how (for stats and tests).
        self.last_preemptions: dict[int, PreemptionMode] = {}
        # Cumulative preemption counts, for stats and for tests that must see both modes.
        self.num_preemptions = {PreemptionMode.RECOMPUTE: 0, PreemptionMode.SWAP: 0}
        # Tokens computed by prefills and tokens sampled, since start.
        self.num_prefill_tokens = 0
        self.num_generation_tokens = 0

    # --- requests -------------------------------------------------------------------------

    def new_req_id(self) -> int:
        return next(self._req_ids)

    def add_request(self, request: Request) -> None:
        """Queue a user request's first sequence (it draws best_of first tokens, unless it is a
        beam search)."""
        params = request.sampling_params
        if not params.use_beam_search:
            request.num_samples = params.best_of
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def finish_requests(self, requests: Iterable[Request], status: RequestStatus) -> None:
        """End requests wherever they are and free their blocks (their last samples may still be
        in flight: they are dropped when they arrive)."""
        for request in requests:
            if request.is_finished or request.req_id not in self.requests:
                continue
            if request.status == RequestStatus.WAITING:
                self.waiting.remove(request)
            elif request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            request.status = status
            self._release(request)

    def _release(self, request: Request) -> None:
        """Free a request that left every queue (its status says why)."""
        self.kv_cache_manager.free(request)
        del self.requests[request.req_id]
        request.group.members.remove(request)
        self._unswap_if_empty(request.group)
        self._finished_req_ids.add(request.req_id)
        self._preempted_req_ids.discard(request.req_id)
        self.isolation.discard(request.req_id)

    def _unswap_if_empty(self, group: RequestGroup) -> None:
        """Take the group off the swapped queue once none of its members is swapped out."""
        if group in self.swapped and not group.members_in(RequestStatus.SWAPPED):
            self.swapped.remove(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def is_isolating(self) -> bool:
        """Whether suspects of a failed step are being tested (see the module docstring)."""
        return self.isolation.active

    def has_requests_needing_host(self) -> bool:
        """Whether a running request's next step waits on the host seeing its newest sample."""
        return any(r.num_output_placeholders and r.needs_host_between_steps for r in self.running)

    # --- scheduling -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        self.last_preemptions = {}
        self.kv_cache_manager.start_step()
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        budget.num_seqs = sum(group.max_running_seqs for group in {r.group for r in self.running})
        scheduled: list[Request] = []
        decodes, prefills = self._schedule_running(out, budget)
        # A decode is one token: those within the budget run (the rest keep their new slot).
        del decodes[max(budget.remaining_tokens, 0) :]
        num_scheduled_tokens = out.num_scheduled_tokens
        for request in decodes:
            num_scheduled_tokens[request.req_id] = 1
        budget.num_batched_tokens += len(decodes)
        scheduled += decodes
        for request in prefills:
            if not self._schedule_tokens(request, budget, out, scheduled):
                break
        isolating = self.isolation.active
        # While isolating, swapped groups (which hold no suspect: suspects are never swapped) wait
        # for the end, and hold back no probe.
        if not isolating and not out.blocks_to_swap_out:
            self._schedule_swapped(budget, out, scheduled)
        if isolating or not self.swapped:
            self._schedule_waiting(budget, out, scheduled)
        out.total_num_scheduled_tokens = budget.num_batched_tokens
        out.preempted_req_ids = self._preempted_req_ids
        self._preempted_req_ids = set()
        self._describe(scheduled, out)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: _Budget) -> tuple[list[Request], list[Request]]:
        """Reserve slots for decoding requests, preempting from the lowest priority up. Only the
        requests the isolation policy admits are considered, and the others are preempted first."""
        if not self._running_sorted:
            self.running.sort(key=_priority)
            self._running_sorted = True
        isolation = self.isolation
        queue = deque(filter(isolation.admits, self.running) if isolation.active else self.running)
        decodes: list[Request] = []
        prefills: list[Request] = []
        kv = self.kv_cache_manager
        windowed = kv.sliding_window is not None
        while queue:
            request = queue.popleft()
            if request.status != RequestStatus.RUNNING:
                continue  # preempted with a sibling of lower priority
            if request.num_output_placeholders and (
                request.needs_host_between_steps or self._ends_with_samples_in_flight(request)
            ):
                continue  # its next step waits for the host to see its sample, or never comes
            if windowed:  # first, so that the blocks it frees can take this step's tokens
                kv.slide_window(request)
            num_new_tokens = request.num_uncomputed_tokens
            if num_new_tokens > 1 or not (request.output_token_ids or request.num_output_placeholders):
                prefills.append(request)  # its blocks were allocated at admission
                continue
            while True:
                appended = kv.try_append_slot(request)
                if appended is not False:
                    if appended is not True:
                        out.blocks_to_copy.append(appended)
                    decodes.append(request)
                    break
                if self._preempt_outside_probe(budget, out):
                    continue
                # Requests already kept have higher priority: victims come from the tail (one
                # preempted already, as a sibling of an earlier victim, frees nothing more).
                victim = queue.pop() if queue else request
                if victim is not request and victim.status != RequestStatus.RUNNING:
                    continue
                self._preempt(victim, out, decodes, prefills)
                if victim is request or request.status != RequestStatus.RUNNING:
                    break
        return decodes, prefills

    def _ends_with_samples_in_flight(self, request: Request) -> bool:
        """Whether the samples in flight take the request to its length limit (max_tokens or the
        context): no step after them is needed, and a token past the context has no slot."""
        max_tokens = request.sampling_params.max_tokens
        num_outputs = request.num_output_tokens + request.num_output_placeholders
        max_context_len = self.max_context_len
        return (max_context_len is not None and request.num_computed_tokens >= max_context_len) or (
            max_tokens is not None and num_outputs >= max_tokens
        )

    def _schedule_swapped(self, budget: _Budget, out: SchedulerOutput, scheduled: list[Request]) -> None:
        kv = self.kv_cache_manager
        while self.swapped:
            group = self.swapped[0]
            members = group.members_in(RequestStatus.SWAPPED)
            if any(r.num_output_placeholders for r in members):
                break  # its last samples are still in flight
            status = kv.can_swap_in(members)
            if status == AllocStatus.NEVER:
                self.swapped.popleft()
                self._stop_for_lack_of_memory(members)
                continue
            if status == AllocStatus.LATER:
                break
            num_seqs = group.max_running_seqs
            if not budget.can_add_seqs(num_seqs) or budget.remaining_tokens < len(members):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(kv.swap_in(members).items())
            budget.num_seqs += num_seqs
            for request in members:
                kv.slide_window(request)
                request.status = RequestStatus.RUNNING
                request.resend = True
                self._add_running(request)
                if request.num_uncomputed_tokens == 1:
                    self._append_slots(request, out)
                self._schedule_tokens(request, budget, out, scheduled)

    def _schedule_waiting(self, budget: _Budget, out: SchedulerOutput, scheduled: list[Request]) -> None:
        """Admit waiting requests, FCFS: those the isolation policy admits, preempting the others
        to make room for them."""
        kv = self.kv_cache_manager
        isolation = self.isolation
        queue = deque(filter(isolation.admits, self.waiting)) if isolation.active else self.waiting
        while queue:
            request = queue[0]
            if request.req_id in self.last_preemptions or request.num_output_placeholders:
                break  # preempted by this step, or its last sample is still in flight
            status = kv.can_allocate(request)
            num_seqs = request.group.max_running_seqs if not self._group_running(request) else 0
            while (
                status == AllocStatus.LATER or not budget.can_add_seqs(num_seqs)
            ) and self._preempt_outside_probe(budget, out):
                status = kv.can_allocate(request)
            if status == AllocStatus.NEVER:
                self._pop_waiting(queue)
                self._ignore(request)
                continue
            if status == AllocStatus.LATER:
                break
            if not budget.can_add_seqs(num_seqs) or not self._fits(request, budget):
                break
            self._pop_waiting(queue)
            kv.allocate(request)
            kv.slide_window(request)  # a prefix-cache hit may start past the window
            request.status = RequestStatus.RUNNING
            request.resend = True
            budget.num_seqs += num_seqs
            self._add_running(request)
            self._schedule_tokens(request, budget, out, scheduled)

    def _pop_waiting(self, queue: deque[Request]) -> None:
        """Take the head of ``queue`` (the waiting queue, or the isolation's view of it) off both."""
        request = queue.popleft()
        if queue is not self.waiting:
            self.waiting.remove(request)

    def _add_running(self, request: Request) -> None:
        if self.running and _priority(request) < _priority(self.running[-1]):
            self._running_sorted = False
        self.running.append(request)

    def _add_forked(self, request: Request) -> None:
        self.requests[request.req_id] = request
        self._add_running(request)

    def _group_running(self, request: Request) -> bool:
        return any(r.status == RequestStatus.RUNNING for r in request.group.members if r is not request)

    def _fits(self, request: Request, budget: _Budget) -> bool:
        """Whether some of the request's tokens fit this step (all of them, without chunking)."""
        if self.config.enable_chunked_prefill:
            return budget.remaining_tokens > 0
        return request.num_tokens - request.num_computed_tokens <= budget.remaining_tokens

    def _schedule_tokens(
        self, request: Request, budget: _Budget, out: SchedulerOutput, scheduled: list[Request]
    ) -> bool:
        """Schedule the request's next tokens within the budget; False when nothing fit."""
        num_tokens = request.num_uncomputed_tokens
        if num_tokens > budget.remaining_tokens:
            if not self.config.enable_chunked_prefill:
                return False
            num_tokens = budget.remaining_tokens
        if num_tokens <= 0:
            return False
        out.num_scheduled_tokens[request.req_id] = num_tokens
        budget.num_batched_tokens += num_tokens
        scheduled.append(request)
        return True

    def _append_slots(self, request: Request, out: SchedulerOutput) -> None:
        cow = self.kv_cache_manager.append_slots(request)
        if cow is not None:
            out.blocks_to_copy.append(cow)

    def _describe(self, scheduled: list[Request], out: SchedulerOutput) -> None:
        """Write each scheduled request into the step's message (in full, or as a diff), then
        advance its progress: the step's tokens count as computed from now on, and a request
        that reaches its end holds a placeholder for the token the step samples."""
        kv = self.kv_cache_manager
        cached = out.scheduled_cached_reqs
        num_scheduled_tokens = out.num_scheduled_tokens
        now = time.time()
        windowed = kv.sliding_window is not None
        for request in scheduled:
            req_id = request.req_id
            if windowed and (request.resend or kv.has_unsent_blocks(request)):
                out.num_dropped_tokens[req_id] = kv.get_num_dropped_tokens(request)
            if request.resend:
                request.resend = False
                group = request.group
                out.scheduled_new_reqs.append(
                    NewRequestData(
                        req_id=req_id,
                        seed=sibling_seed(request.sampling_params.seed, request.output_index),
                        prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=request.output_token_ids.copy(),
                        sampling_params=request.sampling_params,
                        block_ids=kv.get_block_ids(request).copy(),
                        num_computed_tokens=request.num_computed_tokens,
                        num_samples=request.num_samples,
                        min_tokens_stop_ids=group.min_tokens_stop_ids,
                        num_top_tokens=group.num_top_tokens,
                    )
                )
                kv.mark_sent(request)
            else:
                cached.req_ids.append(req_id)
                cached.block_table_diffs.append(kv.take_block_table_diff(request))
                cached.num_computed_tokens.append(request.num_computed_tokens)
            num_new_tokens = num_scheduled_tokens[req_id]
            num_computed_tokens = request.num_computed_tokens
            num_prompt_tokens = len(request.prompt_token_ids)
            if num_new_tokens > 1 or num_computed_tokens < num_prompt_tokens:
                self.num_prefill_tokens += num_new_tokens
            num_computed_tokens += num_new_tokens
            request.num_computed_tokens = num_computed_tokens
            num_known_tokens = num_prompt_tokens + len(request.output_token_ids)
            if num_computed_tokens == num_known_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now

    # --- after the step -------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput
    ) -> SampledRequests:
        """Apply a step's samples: each replaces one placeholder of its request with a token.

        A best_of request's first sample has ``best_of`` rows: the fan-out forks a sibling for each
        row but the first. Beam search requests are returned for the engine's beam driver to
        choose their continuations (``FanOut.apply_beam_step``). Samples of requests
        that finished or were preempted meanwhile are dropped (a stopped request may have had one
        more token computed; it is never returned).
        """
        result = SampledRequests()
        requests = self.requests
        kv = self.kv_cache_manager
        token_ids = output.sampled_token_ids
        logprobs = output.logprobs
        req_ids = output.req_ids
        num_rows = len(req_ids)
        appended = result.appended
        row = 0
        while row < num_rows:
            request = requests.get(req_ids[row])
            if request is None:
                row += 1
                continue
            request.num_output_placeholders -= 1
            self.num_generation_tokens += 1
            if not request.needs_host_between_steps:
                # The common case: one token for one request.
                request.append_output_token(token_ids[row], logprobs[row])
                appended.append((request, row))
                row += 1
                continue
            if request.sampling_params.use_beam_search:
                result.beams.append((request, row))
                row += 1
                continue
            samplers = self.fanout.fork_first_samples(request)
            num_samples = len(samplers)
            result.forked += [(request, child) for child in samplers[1:]]
            for i, sampler in enumerate(samplers):
                sampler.append_output_token(token_ids[row + i], logprobs[row + i])
                appended.append((sampler, row + i))
            self.num_generation_tokens += num_samples - 1
            row += num_samples
        if kv.enable_prefix_caching:
            self._cache_computed_blocks(scheduler_output)
        self.isolation.sampled(req_ids)
        return result

    def _cache_computed_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """Register the blocks the step filled in the prefix cache. Only now, and only up to what
        this step computed: with asynchronous scheduling the next step is already launched, and
        were it dropped its blocks must not be found by anyone."""
        kv = self.kv_cache_manager
        computed = {data.req_id: data.num_computed_tokens for data in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                kv.cache_blocks(request, computed[req_id] + num_tokens)

    # --- preemption -----------------------------------------------------------------------

    def _preempt(
        self, request: Request, out: SchedulerOutput, decodes: list[Request], prefills: list[Request]
    ) -> None:
        group = request.group
        members = group.members_in(RequestStatus.RUNNING)
        if not members:
            return
        kv = self.kv_cache_manager
        # While isolating, preemption recomputes: swapped groups come back only once it is over,
        # and a probe's requests must not wait for that. Behind a sliding window a request holds
        # a few blocks but would need all of its tokens' again to recompute: it swaps.
        alone = len(members) == 1 and kv.sliding_window is None
        mode = PreemptionMode.RECOMPUTE if alone or self.isolation.active else PreemptionMode.SWAP
        if mode == PreemptionMode.SWAP and not kv.can_swap_out(members):
            logger.warning(
                "request %d: CPU swap space is full, recomputing its %d sequences instead; "
                "raise swap_space to avoid this",
                request.req_id,
                len(members),
            )
            mode = PreemptionMode.RECOMPUTE
        for member in members:
            # A copy-on-write given this step is not made yet: a swap out would move the empty copy.
            copy = kv.undo_copy_on_write(member)
            if copy is not None:
                out.blocks_to_copy.remove(copy)
            self.running.remove(member)
            for scheduled in (decodes, prefills):
                if member in scheduled:
                    scheduled.remove(member)
            self._preempted_req_ids.add(member.req_id)
            self.last_preemptions[member.req_id] = mode
        if mode == PreemptionMode.RECOMPUTE:
            for member in reversed(members):
                kv.free(member)
                member.num_computed_tokens = 0
                member.status = RequestStatus.WAITING
                self.waiting.appendleft(member)
        else:
            out.blocks_to_swap_out.extend(kv.swap_out(members).items())
            for member in members:
                member.status = RequestStatus.SWAPPED
            if group not in self.swapped:  # members of it may be swapped out already
                self.swapped.append(group)
        self.num_preemptions[mode] += 1

    def _preempt_outside_probe(self, budget: _Budget, out: SchedulerOutput) -> bool:
        """Preempt the group the isolation policy names to make room for a probe; False when it
        names none (always, when not isolating)."""
        victim = self.isolation.victim_outside_probe(self.running)
        if victim is None:
            return False
        budget.num_seqs -= victim.group.max_running_seqs
        self._preempt(victim, out, [], [])
        return True

    # --- isolation of a failing request ---------------------------------------------------

    def isolate_failure(self, dropped: list[SchedulerOutput], error: str) -> None:
        """Take back steps that raised, and narrow down the user request responsible.

        ``dropped``: the steps whose samples will never come (the one that raised and, with
        asynchronous scheduling, the other one launched). Every live request they computed is a
        suspect; requests holding blocks they were to swap lost their copy. Both are preempted
        by RECOMPUTE. When the suspects are all in the running probe and are one user request,
        it is the culprit: its live sequences finish with FINISHED_ERROR and ``error``, and are
        reported through ``stopped``. Otherwise the isolation policy tests them again, apart.
        """
        requests = self.requests
        suspect_ids: dict[int, None] = {}
        swapped_in: set[int] = set()
        swapped_out: set[int] = set()
        for out in dropped:
            # The workers may not have applied these: they come again with the next step.
            self._finished_req_ids |= out.finished_req_ids
            self._preempted_req_ids |= {req_id for req_id in out.preempted_req_ids if req_id in requests}
            suspect_ids.update(dict.fromkeys(r for r in out.num_scheduled_tokens if r in requests))
            swapped_in.update(dst for _, dst in out.blocks_to_swap_in)
            swapped_out.update(dst for _, dst in out.blocks_to_swap_out)
        kv = self.kv_cache_manager
        lost = set(kv.holders(swapped_in, Device.DEVICE)) | set(kv.holders(swapped_out, Device.CPU))
        lost_copies = [requests[req_id] for req_id in lost if req_id not in suspect_ids]
        suspects = sorted((requests[req_id] for req_id in suspect_ids), key=_priority)
        convicted = self.isolation.after_failure(suspects)
        if convicted is not None:
            culprits = list(convicted.members)
            for request in culprits:
                request.error = error
            self.stopped.extend(culprits)
            self.finish_requests(culprits, RequestStatus.FINISHED_ERROR)
            self._requeue(lost_copies)
            return
        self._requeue(suspects + lost_copies)

    def _requeue(self, requests: list[Request]) -> None:
        """Preempt by RECOMPUTE wherever they are, without their samples in flight (their steps
        were dropped): they keep their tokens, wait at the front of the queue in priority order,
        and the workers drop their rows until they are sent again in full."""
        if not requests:
            return
        req_ids = {r.req_id for r in requests}
        self.running = [r for r in self.running if r.req_id not in req_ids]
        self.waiting = deque(r for r in self.waiting if r.req_id not in req_ids)
        for request in requests:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0
            request.status = RequestStatus.WAITING
            self._unswap_if_empty(request.group)
            self._preempted_req_ids.add(request.req_id)
        self.waiting.extendleft(sorted(requests, key=_priority, reverse=True))

    def _stop_for_lack_of_memory(self, group: list[Request]) -> None:
        """End a group whose requests together outgrew the whole cache: waiting for memory would
        wait forever (and hold back every waiting request). Its outputs so far are kept."""
        error = (
            f"stopped after {group[0].num_output_tokens} tokens: its {len(group)} sequences need more KV "
            f"cache blocks than the cache has ({self.kv_cache_manager.num_total_gpu_blocks}); give the "
            "cache more memory or ask for fewer sequences (n, best_of)"
        )
        logger.warning("request %d: %s", group[0].req_id, error)
        for request in group:
            request.error = error
            self.stopped.append(request)
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            self._release(request)

    def _ignore(self, request: Request) -> None:
        kv = self.kv_cache_manager
        num_blocks = -(-request.num_tokens // self.block_size)
        error = (
            f"request needs {num_blocks} KV cache blocks but the cache has "
            f"{kv.num_total_gpu_blocks - kv.watermark_blocks} to give (num_kv_blocks / memory too small)"
        )
        if request.num_tokens > self.config.max_model_len:
            # Only attention sinks let a request grow past max_model_len; recomputing it would
            # need every block of its history at once.
            error = (
                f"stopped after {request.num_output_tokens} tokens: preempted past max_model_len="
                f"{self.config.max_model_len}, it could only resume by swapping, and the CPU swap space "
                "was full; raise swap_space"
            )
        logger.warning("request %d ignored: %s", request.req_id, error)
        request.error = error
        self.stopped.append(request)
        request.status = RequestStatus.FINISHED_IGNORED
        self._release(request)
