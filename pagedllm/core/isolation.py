"""Probes: the suspects of a failed model step, tested apart from everything else.

When a model step raises, every request it computed becomes a suspect (the scheduler's
``isolate_failure``). Suspects are tested in *probes*: while one runs, its requests are the only
ones scheduled, until each has sampled once, which clears them. A failure whose requests all
belong to the running probe and to one user request convicts it. A failure of several user
requests splits them into two probes, run first (binary search: k bad requests among n cost
about k log2 n probes, not n), so a request that fails alone is always found and one that does
not is never blamed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class _Probe:
    """Suspects run together with no other request, until each has sampled once."""

    req_ids: set[int]
    unsampled: set[int]


class Probes:
    """The probes waiting to run, the running one first."""

    def __init__(self) -> None:
        self._queue: deque[_Probe] = deque()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def running(self) -> set[int] | None:
        """The request ids of the running probe, None when no probe runs."""
        return self._queue[0].req_ids if self._queue else None

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

    def after_failure(self, suspects: list[list[int]]) -> bool:
        """A step failed with ``suspects`` (their request ids, one list per user request, in
        priority order). True when that convicts the only user request among them: all of its
        suspects belong to the running probe. Otherwise they are tested again first: in two new
        probes (one for a single user request), ahead of the others."""
        suspect_ids = {req_id for group in suspects for req_id in group}
        running = self.running() or set()
        convicted = len(suspects) == 1 and suspect_ids <= running
        for probe in self._queue:
            # Requests of the running probe that sampled passed; the suspects are tested again.
            probe.unsampled -= suspect_ids
            probe.req_ids &= probe.unsampled
        self._queue = deque(probe for probe in self._queue if probe.req_ids)
        if convicted:
            return True
        half = len(suspects) // 2
        for part in reversed([suspects[:half], suspects[half:]] if half else [suspects]):
            req_ids = {req_id for group in part for req_id in group}
            if req_ids:
                self._queue.appendleft(_Probe(req_ids, set(req_ids)))
        return False

    def _end_passed(self) -> None:
        """End the running probe once each of its requests has sampled or finished: they rejoin
        normal batching, and the next probe runs."""
        while self._queue and not self._queue[0].unsampled:
            self._queue.popleft()
