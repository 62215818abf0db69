"""Isolation: the policy the scheduler asks while the suspects of a failed model step are tested.

When a model step raises, every request it computed becomes a suspect (the scheduler's
``isolate_failure``). Suspects are tested in *probes*: while one runs, only its requests are
admitted (``admits``), and to make room for them the scheduler preempts groups with no request
in it (``victim_outside_probe``), until each has sampled once, which clears them. A failure whose
requests all belong to the running probe and to one group (one user request) convicts it. A
failure of several groups splits them into two probes, run first (binary search: k bad requests
among n cost about k log2 n probes, not n), so a request that fails alone is always found and
one that does not is never blamed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from pagedllm.core.block_pool import Device
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestGroup, priority
from pagedllm.step_io import SchedulerOutput


def suspects_of(
    dropped: list[SchedulerOutput], requests: dict[int, Request], kv_cache_manager: KVCacheManager
) -> tuple[list[Request], list[Request]]:
    """The live requests that ``dropped`` steps computed (the suspects, in priority order), and
    the others whose blocks they were to swap (that copy is lost; they are not suspects)."""
    suspect_ids: dict[int, None] = {}
    swapped_in: set[int] = set()
    swapped_out: set[int] = set()
    for out in dropped:
        suspect_ids.update(dict.fromkeys(r for r in out.num_scheduled_tokens if r in requests))
        swapped_in.update(dst for _, dst in out.blocks_to_swap_in)
        swapped_out.update(dst for _, dst in out.blocks_to_swap_out)
    kv = kv_cache_manager
    lost = set(kv.holders(swapped_in, Device.DEVICE)) | set(kv.holders(swapped_out, Device.CPU))
    lost_copies = [requests[req_id] for req_id in lost if req_id not in suspect_ids]
    suspects = sorted((requests[req_id] for req_id in suspect_ids), key=priority)
    return suspects, lost_copies


@dataclass
class _Probe:
    """Suspects run together with no other request, until each has sampled once."""

    req_ids: set[int]
    unsampled: set[int]


class IsolationPolicy:
    """The probes waiting to run, the running one first."""

    def __init__(self) -> None:
        self._queue: deque[_Probe] = deque()

    @property
    def active(self) -> bool:
        """Whether suspects are being tested: preemption then recomputes (a probe's requests must
        not wait for swapped groups), and swapped groups wait for the end."""
        return bool(self._queue)

    def probe(self) -> set[int] | None:
        """The request ids of the running probe, None when no probe runs."""
        return self._queue[0].req_ids if self._queue else None

    def admits(self, request: Request) -> bool:
        """Whether the request may be scheduled: any may, unless a probe runs without it."""
        return not self._queue or request.req_id in self._queue[0].req_ids

    def victim_outside_probe(self, running: list[Request]) -> Request | None:
        """The lowest-priority request of ``running`` (in priority order) whose group has no
        request in the running probe: it would wait for the probe anyway. None when there is
        none, or no probe runs."""
        if not self._queue:
            return None
        probe = self._queue[0].req_ids
        for request in reversed(running):
            if not any(member.req_id in probe for member in request.group.members):
                return request
        return None

    def sampled(self, req_ids: Iterable[int]) -> None:
        """These requests sampled: those of the running probe are cleared."""
        if self._queue:
            self._queue[0].unsampled.difference_update(req_ids)
            self._end_passed()

    def discard(self, req_id: int) -> None:
        """The request ended: no probe waits for it."""
        if self._queue:
            for probe in self._queue:
                probe.req_ids.discard(req_id)
                probe.unsampled.discard(req_id)
            self._end_passed()

    def after_failure(self, suspects: list[Request]) -> RequestGroup | None:
        """A step failed with ``suspects`` (in priority order). Returns the group it convicts:
        the only one among them, when all of them belong to the running probe. Otherwise they are
        tested again first: in two new probes (one for a single group), ahead of the others."""
        by_group: dict[RequestGroup, list[int]] = {}
        for request in suspects:
            by_group.setdefault(request.group, []).append(request.req_id)
        groups = list(by_group.values())
        suspect_ids = {request.req_id for request in suspects}
        convicted = len(groups) == 1 and suspect_ids <= (self.probe() or set())
        for probe in self._queue:
            # Requests of the running probe that sampled passed; the suspects are tested again.
            probe.unsampled -= suspect_ids
            probe.req_ids &= probe.unsampled
        self._queue = deque(probe for probe in self._queue if probe.req_ids)
        if convicted:
            return suspects[0].group
        half = len(groups) // 2
        for part in reversed([groups[:half], groups[half:]] if half else [groups]):
            req_ids = {req_id for group in part for req_id in group}
            if req_ids:
                self._queue.appendleft(_Probe(req_ids, set(req_ids)))
        return None

    def _end_passed(self) -> None:
        """End the running probe once each of its requests has sampled or finished: they rejoin
        normal batching, and the next probe runs."""
        while self._queue and not self._queue[0].unsampled:
            self._queue.popleft()
