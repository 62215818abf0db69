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

``update_from_output()`` applies a step's samples: registers computed blocks in the prefix cache,
appends tokens, has the fan-out fork a best_of request after its first sample (``core/fanout.py``,
which beam search's driver uses too), and ends the requests a token stops (EOS, stop token ids,
max_tokens, the context: ``core/stop_conditions.py``) and pooling requests, whose prompt gave a
vector. Only the core changes a request's progress or blocks; the engine reads requests, matches
stop strings and asks the scheduler to finish what they end. Where requests are and how they
move between queues is ``core/request_queues.py``'s; this module decides who moves.

Isolation (``isolate_failure()``): when a model step raises, the engine drops it (and the step in
flight with it) and the scheduler looks for the group responsible, so that only that one fails.
Every request the dropped steps computed becomes a suspect, preempted by RECOMPUTE (it keeps its
tokens; the samples in flight are gone); the isolation policy (``core/isolation.py``) then says
which requests may run, until one group is convicted or all are cleared.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
from pagedllm.core.fanout import FanOut
from pagedllm.core.isolation import IsolationPolicy, suspects_of
from pagedllm.core.kv_cache_manager import AllocStatus, KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queues import PreemptionMode, RequestQueues
from pagedllm.core.spec_decode import SpecDecoding
from pagedllm.core.step_budget import StepBudget
from pagedllm.core.step_message import describe_step
from pagedllm.core.stop_conditions import sits_out, stop_reason, stop_status
from pagedllm.spec_config import SpeculativeConfig
from pagedllm.step_io import ModelRunnerOutput, SchedulerOutput


@dataclass
class SampledRequests:
    """What ``update_from_output`` did: which requests gained tokens (with each token's output row,
    for its logprobs; some the token ended), which were forked into being, and the beam search
    requests whose candidates the engine must choose from (their rows; nothing was appended)."""

    # (request, row) per appended token; a forked request's first token is in here too.
    appended: list[tuple[Request, int]] = field(default_factory=list)
    forked: list[tuple[Request, Request]] = field(default_factory=list)
    beams: list[tuple[Request, int]] = field(default_factory=list)
    # A pooling model's requests the step completed, each with its vector (they ended here).
    pooled: list[tuple[Request, list[float]]] = field(default_factory=list)


class Scheduler:
    """Decides each step from the queues it owns, with the KV cache manager, the fan-out and the
    isolation policy.

    Args:
        scheduler_config: the token and sequence budgets, chunked prefill.
        block_size, num_gpu_blocks, num_cpu_blocks, enable_prefix_caching: the KV cache.
        sliding_window, num_sink_tokens: the window every layer attends through (None: some layer
            is global) and the attention sinks kept beside it; blocks behind the window are freed
            and, with sinks, a request's length is not bounded by max_model_len.
        speculative_config: draft tokens for decoding requests, verified by the same step
            (core/spec_decode.py); None: one token per decoding request and step.
        ngram_on_worker: n-gram drafts looked up by the worker on the device (asynchronous
            scheduling: ``EngineConfig.drafts_on_worker``) rather than by the scheduler.
        max_loras: most distinct LoRA adapters running at once (None: no LoRA).
        num_state_slots: recurrent-state slots of a hybrid model (0: none; core/state_cache.py).
        pipeline_parallel_size: P > 1 stages: a request whose sample is in flight sits out, and a
            step decodes at most 1/P of max_num_seqs (steps in flight are different micro-batches).
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
        speculative_config: SpeculativeConfig | None = None,
        ngram_on_worker: bool = False,
        max_loras: int | None = None,
        num_state_slots: int = 0,
        pipeline_parallel_size: int = 1,
    ) -> None:
        self.config = scheduler_config
        self.max_loras = max_loras
        self.waits_for_samples = pipeline_parallel_size > 1
        self.max_step_decodes = -(-scheduler_config.max_num_seqs // pipeline_parallel_size)
        self.kv_cache_manager = KVCacheManager(
            block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
            sliding_window=sliding_window,
            num_sink_tokens=num_sink_tokens,
            max_blocks_per_request=-(-scheduler_config.max_model_len // block_size),
            num_state_slots=num_state_slots,
        )
        self.max_context_len = None if num_sink_tokens else scheduler_config.max_model_len
        self.spec_decoding = (
            None
            if speculative_config is None
            else SpecDecoding(speculative_config, self.max_context_len, ngram_on_worker)
        )
        self._req_ids = itertools.count()
        # Which requests may run while the suspects of failed steps are tested.
        self.isolation = IsolationPolicy()
        self.queues = RequestQueues(self.kv_cache_manager, self.isolation)
        self.fanout = FanOut(
            self.kv_cache_manager, self.new_req_id, self.queues.add_running, self.finish_requests
        )
        # Requests preempted by the last schedule() and how (for stats and tests).
        self.last_preemptions: dict[int, PreemptionMode] = {}
        # Cumulative preemption counts, for stats and for tests that must see both modes.
        self.num_preemptions = {PreemptionMode.RECOMPUTE: 0, PreemptionMode.SWAP: 0}
        # Tokens computed by prefills, and tokens sampled, since start.
        self.num_prefill_tokens = self.num_generation_tokens = 0

    # --- requests (``queues`` holds them; the engine, stats and tests read these) -------------

    @property
    def requests(self) -> dict[int, Request]:
        return self.queues.requests

    @property
    def waiting(self) -> deque[Request]:
        return self.queues.waiting

    @property
    def running(self) -> list[Request]:
        return self.queues.running

    def new_req_id(self) -> int:
        return next(self._req_ids)

    def add_request(self, request: Request) -> None:
        """Queue a user request's first sequence (best_of first tokens, unless a beam search)."""
        params = request.sampling_params
        if not params.use_beam_search:
            request.num_samples = params.best_of
        self.queues.add_waiting(request)

    def finish_requests(self, requests: Iterable[Request], status: RequestStatus) -> None:
        """End requests wherever they are and free their blocks (their last samples may still be
        in flight: they are dropped when they arrive)."""
        self.queues.finish(requests, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.queues.requests)

    @property
    def is_isolating(self) -> bool:
        """Whether suspects of a failed step are being tested (see the module docstring)."""
        return self.isolation.active

    def has_requests_needing_host(self) -> bool:
        """Whether a running request's next step waits on the host seeing its newest sample (or,
        with speculative decoding near its length limit, how many of its drafts were accepted)."""
        spec = self.spec_decoding
        return any(
            r.num_output_placeholders
            and (r.needs_host_between_steps or (spec is not None and spec.waits_for_acceptance(r)))
            for r in self.queues.running
        )

    # --- scheduling -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        queues = self.queues
        out = SchedulerOutput(finished_req_ids=queues.finished_req_ids)
        queues.finished_req_ids = set()
        self.last_preemptions = {}
        self.kv_cache_manager.start_step()
        out.state_slots_to_copy = self.kv_cache_manager.take_state_copies()
        budget = StepBudget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        budget.num_seqs = sum(group.max_running_seqs for group in {r.group for r in queues.running})
        scheduled: list[Request] = []
        drafts: dict[int, list[int]] = {}
        decodes, prefills = self._schedule_running(out, budget, drafts)
        # A decode is one token: those within the budget run (the rest keep their new slot).
        del decodes[max(min(budget.remaining_tokens, self.max_step_decodes), 0) :]
        num_scheduled_tokens = out.num_scheduled_tokens
        for request in decodes:
            num_scheduled_tokens[request.req_id] = 1
        budget.num_batched_tokens += len(decodes)
        if drafts:
            self.spec_decoding.schedule_drafts(decodes, drafts, budget, out, self.kv_cache_manager)
        scheduled += decodes
        for request in prefills:
            if not self._schedule_tokens(request, budget, out, scheduled):
                break
        if self.max_loras is not None:
            budget.max_loras = self.max_loras
            budget.lora_ids = {r.group.lora_int_id for r in queues.running} - {0}
        isolating = self.isolation.active
        # While isolating, swapped groups (which hold no suspect: suspects are never swapped) wait
        # for the end, and hold back no probe.
        if queues.swapped and not isolating and not out.blocks_to_swap_out:
            self._schedule_swapped(budget, out, scheduled)
        if queues.waiting and (isolating or not queues.swapped):
            self._schedule_waiting(budget, out, scheduled)
        out.total_num_scheduled_tokens = budget.num_batched_tokens
        if self.spec_decoding is not None:
            self.spec_decoding.drafter.scheduled(out.drafting)
        out.preempted_req_ids = queues.preempted_req_ids
        queues.preempted_req_ids = set()
        self.num_prefill_tokens += describe_step(scheduled, out, self.kv_cache_manager)
        return out

    def _schedule_running(
        self, out: SchedulerOutput, budget: StepBudget, drafts: dict[int, list[int]]
    ) -> tuple[list[Request], list[Request]]:
        """Reserve slots for decoding requests, preempting from the lowest priority up, among those
        the isolation policy admits (the others are preempted first). With speculative decoding a
        decoding request's drafts go into ``drafts`` and get slots too, when the cache has them
        without preempting anyone."""
        running = self.queues.sorted_running()
        isolation = self.isolation
        queue = deque(filter(isolation.admits, running) if isolation.active else running)
        decodes: list[Request] = []
        prefills: list[Request] = []
        kv = self.kv_cache_manager
        windowed = kv.sliding_window is not None
        max_context_len = self.max_context_len
        spec = self.spec_decoding
        if spec is not None and not spec.is_enabled_for(len(queue)):
            spec = None
            out.drafting = False
        while queue:
            request = queue.popleft()
            if request.status != RequestStatus.RUNNING:
                continue  # preempted with a sibling of lower priority
            if request.num_output_placeholders and sits_out(request, max_context_len, self.waits_for_samples):
                continue
            if windowed:  # first, so that the blocks it frees can take this step's tokens
                kv.slide_window(request)
            num_new_tokens = request.num_uncomputed_tokens
            if num_new_tokens > 1 or not (request.output_token_ids or request.num_output_placeholders):
                prefills.append(request)  # its blocks were allocated at admission
                continue
            request_drafts = spec.propose(request) if spec is not None else None
            while True:
                if request_drafts:
                    appended = kv.try_append_slot(request, 1 + len(request_drafts))
                    if appended is False:
                        request_drafts = None  # the drafts do not fit: the token alone may
                        continue
                    drafts[request.req_id] = request_drafts
                else:
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

    def _schedule_swapped(self, budget: StepBudget, out: SchedulerOutput, scheduled: list[Request]) -> None:
        kv = self.kv_cache_manager
        swapped = self.queues.swapped
        while swapped:
            group = swapped[0]
            members = group.members_in(RequestStatus.SWAPPED)
            if any(r.num_output_placeholders for r in members):
                break  # its last samples are still in flight
            status = kv.can_swap_in(members)
            if status == AllocStatus.NEVER:
                swapped.popleft()
                self.queues.stop_for_lack_of_memory(members)
                continue
            if status == AllocStatus.LATER:
                break
            num_seqs = group.max_running_seqs
            if (
                not budget.can_add_seqs(num_seqs)
                or budget.remaining_tokens < len(members)
                or not budget.admit_lora(group.lora_int_id)
            ):
                break
            swapped.popleft()
            out.blocks_to_swap_in.extend(kv.swap_in(members).items())
            budget.num_seqs += num_seqs
            for request in members:
                kv.slide_window(request)
                request.resend = True
                self.queues.add_running(request)
                if request.num_uncomputed_tokens == 1:
                    cow = kv.append_slots(request)
                    if cow is not None:
                        out.blocks_to_copy.append(cow)
                self._schedule_tokens(request, budget, out, scheduled)

    def _schedule_waiting(self, budget: StepBudget, out: SchedulerOutput, scheduled: list[Request]) -> None:
        """Admit waiting requests, FCFS: those the isolation policy admits, preempting the others
        to make room for them."""
        kv = self.kv_cache_manager
        queues = self.queues
        isolation = self.isolation
        queue = deque(filter(isolation.admits, queues.waiting)) if isolation.active else queues.waiting
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
                queues.ignore(request, self.config.max_model_len)  # off the waiting queue
                if queue is not queues.waiting:
                    queue.popleft()  # and off the isolation's view of it
                continue
            if status == AllocStatus.LATER:
                break
            if (
                not budget.can_add_seqs(num_seqs)
                or not self._fits(request, budget)
                or not budget.admit_lora(request.group.lora_int_id)
            ):
                break
            queues.pop_waiting(queue)
            kv.allocate(request)
            kv.slide_window(request)  # a prefix-cache hit may start past the window
            request.resend = True
            budget.num_seqs += num_seqs
            queues.add_running(request)
            self._schedule_tokens(request, budget, out, scheduled)

    def _group_running(self, request: Request) -> bool:
        return any(r.status == RequestStatus.RUNNING for r in request.group.members if r is not request)

    def _fits(self, request: Request, budget: StepBudget) -> bool:
        """Whether some of the request's tokens fit this step (all of them, without chunking)."""
        if self.config.enable_chunked_prefill:
            return budget.remaining_tokens > 0
        return request.num_tokens - request.num_computed_tokens <= budget.remaining_tokens

    def _schedule_tokens(
        self, request: Request, budget: StepBudget, out: SchedulerOutput, scheduled: list[Request]
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

    # --- after the step -------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput
    ) -> SampledRequests:
        """Apply a step's samples: each replaces one placeholder of its request with a token, and
        a token that stops its request (``stop_status``) ends it here.

        A best_of request's first sample has ``best_of`` rows: the fan-out forks a sibling for each
        row but the first. Beam search requests are returned for the engine's beam driver to
        choose their continuations (``FanOut.apply_beam_step``). Samples of requests that finished
        or were preempted meanwhile are dropped (a stopped request may have had one more token
        computed; it is never returned).
        """
        self.kv_cache_manager.cache_computed_blocks(scheduler_output, self.queues.requests)
        if self.spec_decoding is not None:
            self.spec_decoding.drafter.receive(output)
        result = SampledRequests()
        if output.pooler_output:
            result.pooled = self.queues.finish_pooled(output.pooler_output)
        requests = self.queues.requests
        token_ids = output.sampled_token_ids
        logprobs = output.logprobs
        req_ids = output.req_ids
        num_rows = len(req_ids)
        appended = result.appended
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        kv = self.kv_cache_manager
        row = 0
        while row < num_rows:
            request = requests.get(req_ids[row])
            if request is None:
                row += 1
                continue
            request.num_output_placeholders -= 1
            self.num_generation_tokens += 1
            if spec_tokens and request.req_id in spec_tokens:
                row, num_tokens = self.spec_decoding.apply_verification(
                    request, spec_tokens[request.req_id], row, output, appended, self._stop_if_ends, kv
                )
                self.num_generation_tokens += num_tokens - 1  # the loop counted the first
                continue
            if request.needs_host_between_steps:
                if request.sampling_params.use_beam_search:
                    result.beams.append((request, row))
                    row += 1
                    continue
                samplers = self.fanout.fork_first_samples(request)
                result.forked += [(request, child) for child in samplers[1:]]
                self.num_generation_tokens += len(samplers) - 1
            else:
                samplers = (request,)  # the common case: one token for one request
            for sampler in samplers:
                token_id = token_ids[row]
                sampler.append_output_token(token_id, logprobs[row])
                appended.append((sampler, row))
                self._stop_if_ends(sampler, token_id)
                row += 1
        self.isolation.sampled(req_ids)
        return result

    def _stop_if_ends(self, request: Request, token_id: int) -> bool:
        """End the request if its newest token (``token_id``) stops it; whether it did."""
        status = stop_status(request, token_id, len(request.output_token_ids), self.max_context_len)
        if status is not None:
            self.queues.stop_by_token(request, stop_reason(request, token_id), status)
        return status is not None

    # --- preemption -----------------------------------------------------------------------

    def _preempt(
        self, request: Request, out: SchedulerOutput, decodes: list[Request], prefills: list[Request]
    ) -> None:
        """Preempt the request's group: its running members, out of this step."""
        members = request.group.members_in(RequestStatus.RUNNING)
        if not members:
            return
        kv = self.kv_cache_manager
        # While isolating, preemption recomputes: swapped groups come back only once it is over,
        # and a probe's requests must not wait for that. Behind a sliding window a request holds
        # a few blocks but would need all of its tokens' again to recompute: it swaps.
        alone = len(members) == 1 and kv.sliding_window is None
        mode = PreemptionMode.RECOMPUTE if alone or self.isolation.active else PreemptionMode.SWAP
        mode = self.queues.preempt(members, mode, out)
        for member in members:
            for scheduled in (decodes, prefills):
                if member in scheduled:
                    scheduled.remove(member)
            self.last_preemptions[member.req_id] = mode
        self.num_preemptions[mode] += 1

    def _preempt_outside_probe(self, budget: StepBudget, out: SchedulerOutput) -> bool:
        """Preempt the group the isolation policy names to make room for a probe; False when it
        names none (always, when not isolating)."""
        victim = self.isolation.victim_outside_probe(self.queues.running)
        if victim is None:
            return False
        budget.num_seqs -= victim.group.max_running_seqs
        self._preempt(victim, out, [], [])
        return True

    # --- isolation of a failing request ---------------------------------------------------

    def isolate_failure(self, dropped: list[SchedulerOutput], error: str) -> None:
        """Take back steps that raised, and narrow down the user request responsible.

        ``dropped``: the steps whose samples will never come (the one that raised and the others in
        flight). Every live request they computed is a suspect; requests holding blocks they were to
        swap lost their copy. Both are preempted by RECOMPUTE. When the suspects are all in the
        running probe and are one group, it is the culprit: its live sequences finish with
        FINISHED_ERROR and ``error``, and are reported through ``stopped``. Otherwise the isolation
        policy tests them again, apart.
        """
        queues = self.queues
        queues.report_again(dropped)
        suspects, lost_copies = suspects_of(dropped, queues.requests, self.kv_cache_manager)
        convicted = self.isolation.after_failure(suspects)
        if convicted is not None:
            queues.stop(list(convicted.members), RequestStatus.FINISHED_ERROR, error)
            queues.requeue(lost_copies)
            return
        queues.requeue(suspects + lost_copies)
