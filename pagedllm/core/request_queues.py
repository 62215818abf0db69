"""Where each of the scheduler's requests is, and the moves between its queues.

A live request is in exactly one queue: ``waiting`` (new, or preempted by RECOMPUTE), ``running``
(holding blocks on the device) or, with its group, ``swapped`` (its blocks in the CPU swap space).
The scheduler decides who moves (budgets, priorities, the isolation policy); ``RequestQueues``
moves them and keeps queues, statuses, groups and blocks consistent: preemption, requeueing after
a dropped step, finishing. It collects what the next SchedulerOutput tells the workers (the ids
of finished and preempted requests) and what the engine must take (``stopped``: requests ended
early, with ``Request.error`` saying why).
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Iterable

from pagedllm.core.isolation import IsolationPolicy
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestGroup, RequestStatus, priority
from pagedllm.step_io import SchedulerOutput

logger = logging.getLogger(__name__)


class PreemptionMode(enum.Enum):
    # Free the blocks; the request waits at the front of the queue and computes its tokens again.
    RECOMPUTE = enum.auto()
    # Move the group's blocks to the CPU swap space (shared blocks once) and back later.
    SWAP = enum.auto()


class RequestQueues:
    """The queues; ``isolation`` is told of every request that ends (no probe waits for it)."""

    def __init__(self, kv_cache_manager: KVCacheManager, isolation: IsolationPolicy) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.isolation = isolation
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Whether ``running`` is in priority order (requests join it out of order only rarely).
        self._running_sorted = True
        # Groups whose running members were swapped out together (they come back together).
        self.swapped: deque[RequestGroup] = deque()
        # Reported to the workers by the next SchedulerOutput.
        self.finished_req_ids: set[int] = set()
        self.preempted_req_ids: set[int] = set()
        # Requests ended without running to their end, until the engine takes them.
        self.stopped: list[Request] = []

    def add_waiting(self, request: Request) -> None:
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A request starts running (admitted, swapped in, or a fork: new to ``requests``)."""
        self.requests[request.req_id] = request
        request.status = RequestStatus.RUNNING
        if self.running and priority(request) < priority(self.running[-1]):
            self._running_sorted = False
        self.running.append(request)

    def sorted_running(self) -> list[Request]:
        """``running``, in priority order."""
        if not self._running_sorted:
            self.running.sort(key=priority)
            self._running_sorted = True
        return self.running

    def pop_waiting(self, queue: deque[Request]) -> None:
        """Take the head of ``queue`` (``waiting``, or a filtered view of it) off both."""
        request = queue.popleft()
        if queue is not self.waiting:
            self.waiting.remove(request)

    def stop_by_token(self, request: Request, reason: int | None, status: RequestStatus) -> None:
        """End a request its newest token stopped (``reason``: the stop token id, if one)."""
        if status == RequestStatus.FINISHED_STOPPED:
            request.stop_reason = reason
        self.finish((request,), status)

    def finish_pooled(self, pooler_output: dict[int, list[float]]) -> list[tuple[Request, list[float]]]:
        """A pooling model's requests whose prompt the step completed: each one's vector takes the
        place of its one sample (a pooling request asks for max_tokens=1), and it ends."""
        pooled = []
        for req_id, vector in pooler_output.items():
            request = self.requests.get(req_id)
            if request is None:
                continue  # aborted meanwhile
            request.num_output_placeholders -= 1
            self.finish((request,), RequestStatus.FINISHED_STOPPED)
            pooled.append((request, vector))
        return pooled

    def finish(self, requests: Iterable[Request], status: RequestStatus) -> None:
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

    def stop(self, requests: list[Request], status: RequestStatus, error: str) -> None:
        """End requests early, keeping their outputs so far: the engine reports ``error``."""
        for request in requests:
            request.error = error
        self.stopped.extend(requests)
        self.finish(requests, status)

    def stop_for_lack_of_memory(self, members: list[Request]) -> None:
        """End a group whose swapped-out members together outgrew the whole cache: waiting for
        memory would wait forever (and hold back every waiting request). Outputs so far are kept."""
        error = (
            f"stopped after {members[0].num_output_tokens} tokens: its {len(members)} sequences need more "
            f"KV cache blocks than the cache has ({self.kv_cache_manager.num_total_gpu_blocks}); give the "
            "cache more memory or ask for fewer sequences (n, best_of)"
        )
        logger.warning("request %d: %s", members[0].req_id, error)
        self.stop(members, RequestStatus.FINISHED_LENGTH_CAPPED, error)

    def ignore(self, request: Request, max_model_len: int) -> None:
        """End a waiting request that the cache can never hold."""
        kv = self.kv_cache_manager
        num_blocks = -(-request.num_tokens // kv.block_size)
        error = (
            f"request needs {num_blocks} KV cache blocks but the cache has "
            f"{kv.num_total_gpu_blocks - kv.watermark_blocks} to give (num_kv_blocks / memory too small)"
        )
        if request.num_tokens > max_model_len:
            # Only attention sinks let a request grow past max_model_len; recomputing it would
            # need every block of its history at once.
            error = (
                f"stopped after {request.num_output_tokens} tokens: preempted past max_model_len="
                f"{max_model_len}, it could only resume by swapping, and the CPU swap space was full; "
                "raise swap_space"
            )
        logger.warning("request %d ignored: %s", request.req_id, error)
        self.stop([request], RequestStatus.FINISHED_IGNORED, error)

    def preempt(self, members: list[Request], mode: PreemptionMode, out: SchedulerOutput) -> PreemptionMode:
        """Take a group's running ``members`` off the device, by ``mode`` (RECOMPUTE when SWAP
        finds the CPU space full). Returns the mode used."""
        kv = self.kv_cache_manager
        if mode == PreemptionMode.SWAP and not kv.can_swap_out(members):
            logger.warning(
                "request %d: CPU swap space is full, recomputing its %d sequences instead; "
                "raise swap_space to avoid this",
                members[0].req_id,
                len(members),
            )
            mode = PreemptionMode.RECOMPUTE
        for member in members:
            # A copy-on-write given this step is not made yet: a swap out would move the empty copy.
            copy = kv.undo_copy_on_write(member)
            if copy is not None:
                out.blocks_to_copy.remove(copy)
            self.running.remove(member)
            self.preempted_req_ids.add(member.req_id)
        if mode == PreemptionMode.RECOMPUTE:
            for member in reversed(members):
                kv.free(member)
                member.num_computed_tokens = 0
                member.status = RequestStatus.WAITING
                self.waiting.appendleft(member)
            return mode
        out.blocks_to_swap_out.extend(kv.swap_out(members).items())
        for member in members:
            member.status = RequestStatus.SWAPPED
        group = members[0].group
        if group not in self.swapped:  # members of it may be swapped out already
            self.swapped.append(group)
        return mode

    def report_again(self, dropped: list[SchedulerOutput]) -> None:
        """The ids that ``dropped`` steps reported finished or preempted: the workers may not have
        applied them, so the next step reports them again."""
        for out in dropped:
            self.finished_req_ids |= out.finished_req_ids
            self.preempted_req_ids |= {r for r in out.preempted_req_ids if r in self.requests}

    def requeue(self, requests: list[Request]) -> None:
        """Preempt by RECOMPUTE wherever they are, without their samples in flight (their steps
        were dropped): they keep their tokens, wait at the front of the queue in priority order,
        and the workers drop their rows until they are sent again in full."""
        if not requests:
            return
        req_ids = {r.req_id for r in requests}
        self.running[:] = [r for r in self.running if r.req_id not in req_ids]
        kept = [r for r in self.waiting if r.req_id not in req_ids]
        self.waiting.clear()
        self.waiting.extend(kept)
        for request in requests:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0
            request.status = RequestStatus.WAITING
            self._unswap_if_empty(request.group)
            self.preempted_req_ids.add(request.req_id)
        self.waiting.extendleft(sorted(requests, key=priority, reverse=True))

    def _release(self, request: Request) -> None:
        """Free a request that left every queue (its status says why)."""
        self.kv_cache_manager.free(request)
        del self.requests[request.req_id]
        request.group.members.remove(request)
        self._unswap_if_empty(request.group)
        self.finished_req_ids.add(request.req_id)
        self.preempted_req_ids.discard(request.req_id)
        self.isolation.discard(request.req_id)

    def _unswap_if_empty(self, group: RequestGroup) -> None:
        """Take the group off the swapped queue once none of its members is swapped out."""
        if group in self.swapped and not group.members_in(RequestStatus.SWAPPED):
            self.swapped.remove(group)
