"""Continuous batching: who runs in the next step, under a token budget.

There is no prefill phase and no decode phase. Each sequence has ``num_computed_tokens`` and a
length; a step computes some of the uncomputed tokens of some sequences, at most
``max_num_batched_tokens`` in all. A sequence whose only uncomputed token is its last sampled one
is *decoding*; anything more is a *prefill* (a new prompt, the rest of a chunked prompt, or a
prompt plus outputs being recomputed after preemption). One step mixes both.

Each step, in this order (seed 000, with chunked prefill added):

1. Running groups, highest priority (earliest arrival, FCFS) first. A decoding group needs one
   new slot per sequence; when the cache cannot give them, the lowest-priority running group is
   preempted (the group itself when none is left): RECOMPUTE (free its blocks, back to the front
   of the waiting queue) when it has one unfinished sequence, SWAP (its blocks to the CPU space)
   when it has several, whose outputs would diverge if recomputed separately. Decodes are
   scheduled before prefill chunks, so a long prompt never stalls them.
2. Swapped groups come back, FCFS, unless this step swapped any out.
3. Waiting groups are admitted, FCFS, only when no group is swapped out: swapped groups hold CPU
   memory and come back first.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import AllocStatus, BlockSpaceManager
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)


class PreemptionMode(enum.Enum):
    RECOMPUTE = enum.auto()
    SWAP = enum.auto()


@dataclass
class ScheduledSequenceGroup:
    seq_group: SequenceGroup
    # Tokens whose K/V this step computes, per scheduled sequence (seq_id -> count). A sequence
    # samples its next token when they reach its end.
    num_new_tokens: dict[int, int]


@dataclass
class SchedulerOutputs:
    # Decoding groups first, then prefill chunks, each in priority order.
    scheduled_seq_groups: list[ScheduledSequenceGroup] = field(default_factory=list)
    # Tokens computed by this step (the sum of every num_new_tokens).
    num_batched_tokens: int = 0
    # (CPU block, device block) copies to do before the forward pass.
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # (device block, CPU block) copies to do before the forward pass.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    # (src, dst) device block copies for copy-on-write, before the forward pass.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Groups finished without running: they can never fit in the KV cache.
    ignored_seq_groups: list[SequenceGroup] = field(default_factory=list)
    # Groups preempted by this step, and how.
    preempted: dict[str, PreemptionMode] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (
            self.scheduled_seq_groups
            or self.blocks_to_swap_in
            or self.blocks_to_swap_out
            or self.blocks_to_copy
        )


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


def _fcfs(seq_group: SequenceGroup) -> float:
    return seq_group.arrival_time


class Scheduler:
    """Owns the waiting, running and swapped queues and the block manager."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        enable_prefix_caching: bool = False,
    ) -> None:
        self.config = scheduler_config
        self.block_manager = BlockSpaceManager(
            block_size, num_gpu_blocks, num_cpu_blocks, enable_prefix_caching=enable_prefix_caching
        )
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        # Cumulative preemption counts, for stats and for tests that must see both modes.
        self.num_preemptions = {PreemptionMode.RECOMPUTE: 0, PreemptionMode.SWAP: 0}

    # --- queues ---------------------------------------------------------------------------

    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        self.waiting.append(seq_group)

    def abort_seq_group(self, request_ids: set[str]) -> list[SequenceGroup]:
        """Finish the given requests wherever they are and free their blocks."""
        aborted = []
        for queue in (self.waiting, self.running, self.swapped):
            for seq_group in [sg for sg in queue if sg.request_id in request_ids]:
                queue.remove(seq_group)
                for seq in seq_group.get_unfinished_seqs():
                    seq.status = SequenceStatus.FINISHED_ABORTED
                    self.free_seq(seq)
                aborted.append(seq_group)
        return aborted

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        self.block_manager.fork(parent, child)

    def free_seq(self, seq: Sequence) -> None:
        self.block_manager.free(seq)

    def free_finished_seq_groups(self) -> None:
        self.running = [sg for sg in self.running if not sg.is_finished()]

    # --- scheduling -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutputs:
        out = SchedulerOutputs()
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        decodes, prefills = self._schedule_running(out)
        budget.num_seqs = sum(sg.get_max_num_running_seqs() for sg in self.running)
        for seq_group in decodes:
            self._schedule_tokens(seq_group, budget, out)
        for seq_group in prefills:
            if not self._schedule_tokens(seq_group, budget, out):
                break
        if not out.blocks_to_swap_out:
            self._schedule_swapped(budget, out)
        if not self.swapped:
            self._schedule_waiting(budget, out)
        out.num_batched_tokens = budget.num_batched_tokens
        return out

    def _schedule_running(self, out: SchedulerOutputs) -> tuple[list[SequenceGroup], list[SequenceGroup]]:
        """Reserve slots for decoding groups, preempting from the lowest priority up."""
        queue = deque(sorted(self.running, key=_fcfs))
        running: list[SequenceGroup] = []
        decodes: list[SequenceGroup] = []
        prefills: list[SequenceGroup] = []
        while queue:
            seq_group = queue.popleft()
            if seq_group.is_prefill():
                # Its blocks were allocated at admission: a chunk needs no new slot.
                running.append(seq_group)
                prefills.append(seq_group)
                continue
            while not self.block_manager.can_append_slots(seq_group):
                # Groups already kept have higher priority: victims come from the tail.
                victim = queue.pop() if queue else seq_group
                self._preempt(victim, out)
                if victim is seq_group:
                    break
            else:
                self._append_slots(seq_group, out)
                running.append(seq_group)
                decodes.append(seq_group)
        self.running = running
        return decodes, prefills

    def _schedule_swapped(self, budget: _Budget, out: SchedulerOutputs) -> None:
        while self.swapped:
            seq_group = self.swapped[0]
            status = self.block_manager.can_swap_in(seq_group)
            if status == AllocStatus.NEVER:
                self.swapped.popleft()
                self._stop_for_lack_of_memory(seq_group, out)
                continue
            if status == AllocStatus.LATER:
                break
            num_seqs = seq_group.get_max_num_running_seqs()
            if not budget.can_add_seqs(num_seqs) or budget.remaining_tokens < num_seqs:
                break
            self.swapped.popleft()
            mapping = self.block_manager.swap_in(seq_group)
            out.blocks_to_swap_in.extend(mapping.items())
            for seq in seq_group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            budget.num_seqs += num_seqs
            self.running.append(seq_group)
            if not seq_group.is_prefill():
                self._append_slots(seq_group, out)
            self._schedule_tokens(seq_group, budget, out)

    def _schedule_waiting(self, budget: _Budget, out: SchedulerOutputs) -> None:
        preempted = set(out.preempted)
        while self.waiting:
            seq_group = self.waiting[0]
            if seq_group.request_id in preempted:
                break
            status = self.block_manager.can_allocate(seq_group)
            if status == AllocStatus.NEVER:
                self.waiting.popleft()
                self._ignore(seq_group, out)
                continue
            if status == AllocStatus.LATER:
                break
            num_seqs = seq_group.get_max_num_running_seqs()
            if not budget.can_add_seqs(num_seqs) or not self._fits(seq_group, budget):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq_group)
            for seq in seq_group.get_seqs(SequenceStatus.WAITING):
                seq.status = SequenceStatus.RUNNING
            budget.num_seqs += num_seqs
            self.running.append(seq_group)
            self._schedule_tokens(seq_group, budget, out)

    def _fits(self, seq_group: SequenceGroup, budget: _Budget) -> bool:
        """Whether some of the group's prompt fits this step (all of it, without chunking)."""
        num_tokens = sum(
            seq.get_num_uncomputed_tokens() for seq in seq_group.get_seqs(SequenceStatus.WAITING)
        )
        if self.config.enable_chunked_prefill:
            return budget.remaining_tokens > 0
        return num_tokens <= budget.remaining_tokens

    def _schedule_tokens(self, seq_group: SequenceGroup, budget: _Budget, out: SchedulerOutputs) -> bool:
        """Schedule the group's next tokens within the budget; False when nothing fit."""
        num_new_tokens: dict[int, int] = {}
        for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
            num_tokens = seq.get_num_uncomputed_tokens()
            if num_tokens > budget.remaining_tokens:
                if not self.config.enable_chunked_prefill:
                    break
                num_tokens = budget.remaining_tokens
            if num_tokens == 0:
                break
            num_new_tokens[seq.seq_id] = num_tokens
            budget.num_batched_tokens += num_tokens
        if not num_new_tokens:
            return False
        if seq_group.metrics.first_scheduled_time is None:
            seq_group.metrics.first_scheduled_time = time.time()
        out.scheduled_seq_groups.append(ScheduledSequenceGroup(seq_group, num_new_tokens))
        return True

    def _append_slots(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None:
        for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
            cow = self.block_manager.append_slots(seq)
            if cow is not None:
                out.blocks_to_copy.append(cow)

    # --- preemption -----------------------------------------------------------------------

    def _preempt(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None:
        mode = PreemptionMode.RECOMPUTE if seq_group.num_unfinished_seqs() == 1 else PreemptionMode.SWAP
        if mode == PreemptionMode.SWAP and not self.block_manager.can_swap_out(seq_group):
            logger.warning(
                "request %s: CPU swap space is full, recomputing its %d sequences instead; "
                "raise swap_space to avoid this",
                seq_group.request_id,
                seq_group.num_unfinished_seqs(),
            )
            mode = PreemptionMode.RECOMPUTE
        if mode == PreemptionMode.RECOMPUTE:
            for seq in seq_group.get_unfinished_seqs():
                self.free_seq(seq)
                seq.reset_for_recompute()
            self.waiting.appendleft(seq_group)
        else:
            mapping = self.block_manager.swap_out(seq_group)
            out.blocks_to_swap_out.extend(mapping.items())
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq_group)
        self.num_preemptions[mode] += 1
        out.preempted[seq_group.request_id] = mode

    def _stop_for_lack_of_memory(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None:
        """End a request whose sequences together outgrew the whole cache: waiting for memory
        would wait forever (and hold back every waiting request). Its outputs so far are kept."""
        seqs = seq_group.get_unfinished_seqs()
        seq_group.error = (
            f"stopped after {seqs[0].num_output_tokens} tokens: its {len(seqs)} sequences need more KV "
            f"cache blocks than the cache has ({self.block_manager.num_total_gpu_blocks}); give the cache "
            "more memory or ask for fewer sequences (n, best_of)"
        )
        logger.warning("request %s: %s", seq_group.request_id, seq_group.error)
        for seq in seqs:
            self.free_seq(seq)
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        out.ignored_seq_groups.append(seq_group)

    def _ignore(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None:
        num_blocks = sum(seq.num_logical_blocks for seq in seq_group.get_seqs(SequenceStatus.WAITING))
        bm = self.block_manager
        seq_group.error = (
            f"request needs {num_blocks} KV cache blocks but the cache has "
            f"{bm.num_total_gpu_blocks - bm.watermark_blocks} to give (num_kv_blocks / memory too small)"
        )
        logger.warning("request %s ignored: %s", seq_group.request_id, seq_group.error)
        for seq in seq_group.get_seqs():
            seq.status = SequenceStatus.FINISHED_IGNORED
        out.ignored_seq_groups.append(seq_group)
