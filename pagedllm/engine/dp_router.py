"""Which data-parallel engine replica serves a request: the least loaded, unless one holds its
prefix.

With ``data_parallel_size`` N the server runs N engine cores (each ``tensor_parallel_size``
devices) behind one frontend (dp_client.py). The frontend knows every request it sent and how
far each has come, so the router reads the load from there instead of asking the replicas (vLLM's
DP coordinator gathers the replicas' queue lengths; one frontend needs no coordinator):

    load(engine) = requests outstanding there
                   + their prompt tokens still waiting for a first token / WAITING_TOKENS_PER_REQUEST

A request still prefilling costs its replica the time of its prompt; one decoding, a slot in
every step. ``WAITING_TOKENS_PER_REQUEST`` prices a prompt of that many tokens not yet run as one
more request.

Prefix affinity: a request whose prompt starts with the same full KV blocks as a recent request
(keyed by the prefix cache's own block hashes, ``hash_block_tokens``, over the same block size)
goes where that request went, so that the turns of a conversation land on the replica whose
prefix cache holds their past, unless that replica's load exceeds the least load by more than
``affinity_margin``: a hot prefix then spreads rather than queueing on one replica (it is
computed once more on another, which then caches it too). The deepest matching block wins: a
shared system prompt matches everyone, a conversation's own turns only itself.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pagedllm.core.request import hash_block_tokens

# A prompt of this many tokens not yet run weighs as one more outstanding request.
WAITING_TOKENS_PER_REQUEST = 256
# Prefix affinity yields when the affine replica's load exceeds the least load by more than this
# (in requests): past it, queueing costs more than recomputing the prefix does.
AFFINITY_MARGIN = 4.0
# Block hashes remembered for affinity (least recently routed forgotten first): 64 K blocks of 16
# tokens cover a million prompt tokens, far more than the replicas' caches keep.
MAX_AFFINITY_BLOCKS = 1 << 16


class _RequestMetrics(Protocol):
    first_token_time: float | None


class FrontendRequest(Protocol):
    """What the router reads of a live request in the frontend (the output processor's state)."""

    metrics: _RequestMetrics


@dataclass
class EngineLoad:
    """One replica's load as the frontend knows it."""

    num_requests: int = 0
    # Prompt tokens of its requests that have no first token yet.
    num_waiting_tokens: int = 0

    @property
    def score(self) -> float:
        return self.num_requests + self.num_waiting_tokens / WAITING_TOKENS_PER_REQUEST


@dataclass
class _Routed:
    engine: int
    num_prompt_tokens: int


class DataParallelRouter:
    """Picks a replica per request and remembers where each live request went.

    Args:
        num_engines: the replicas (``data_parallel_size``).
        block_size: tokens per KV block of the replicas' caches (the prefix hash's unit).
        prefix_affinity: route by prompt prefix (on when the replicas cache prefixes; without a
            prefix cache there is nothing to find again).
        affinity_margin: how much more loaded than the least loaded the affine replica may be.

    ``track(requests)`` hands it the frontend's live requests (request_id -> state); a request
    that has left that mapping (finished, aborted, failed) no longer counts, and is forgotten at
    the next ``route``. Call everything from one thread (the event loop).
    """

    def __init__(
        self,
        num_engines: int,
        block_size: int,
        prefix_affinity: bool = True,
        affinity_margin: float = AFFINITY_MARGIN,
    ) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.num_engines = num_engines
        self.block_size = block_size
        self.prefix_affinity = prefix_affinity
        self.affinity_margin = affinity_margin
        self._live: Mapping[str, FrontendRequest] = {}
        self._routed: dict[str, _Routed] = {}
        # Block hash -> the replica that last ran a prompt with that prefix (LRU order).
        self._prefix_engine: collections.OrderedDict[int, int] = collections.OrderedDict()
        # Requests routed to each replica, and how many of them by prefix affinity.
        self.num_routed = [0] * num_engines
        self.num_affinity_hits = 0

    def track(self, requests: Mapping[str, FrontendRequest]) -> None:
        self._live = requests

    def route(self, request_id: str, prompt_token_ids: Sequence[int], cache_salt: Any = None) -> int:
        """The replica for a new request; it is remembered as there until it leaves the frontend.

        ``cache_salt``: what the prefix cache chains its first block from (the LoRA adapter's
        salt; None without one), so that prompts under different adapters never look alike."""
        loads = self.loads()
        least = min(range(self.num_engines), key=lambda engine: loads[engine].score)
        engine = least
        hashes = self._block_hashes(prompt_token_ids, cache_salt) if self.prefix_affinity else []
        affine = self._affine_engine(hashes)
        if affine is not None and loads[affine].score <= loads[least].score + self.affinity_margin:
            engine = affine
            self.num_affinity_hits += 1
        for block_hash in hashes:
            self._prefix_engine[block_hash] = engine
            self._prefix_engine.move_to_end(block_hash)
        while len(self._prefix_engine) > MAX_AFFINITY_BLOCKS:
            self._prefix_engine.popitem(last=False)
        self._routed[request_id] = _Routed(engine, len(prompt_token_ids))
        self.num_routed[engine] += 1
        return engine

    def engine_of(self, request_id: str) -> int | None:
        """Where a live request runs (None: never routed, or forgotten)."""
        routed = self._routed.get(request_id)
        return None if routed is None else routed.engine

    def loads(self) -> list[EngineLoad]:
        """Each replica's load now; forgets the requests the frontend no longer holds."""
        loads = [EngineLoad() for _ in range(self.num_engines)]
        gone = []
        for request_id, routed in self._routed.items():
            state = self._live.get(request_id)
            if state is None:
                gone.append(request_id)
                continue
            load = loads[routed.engine]
            load.num_requests += 1
            if state.metrics.first_token_time is None:
                load.num_waiting_tokens += routed.num_prompt_tokens
        for request_id in gone:
            del self._routed[request_id]
        return loads

    def _block_hashes(self, token_ids: Sequence[int], cache_salt: Any) -> list[int]:
        hashes: list[int] = []
        prev = cache_salt
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            prev = hash_block_tokens(prev, token_ids[start : start + self.block_size])
            hashes.append(prev)
        return hashes

    def _affine_engine(self, hashes: list[int]) -> int | None:
        """The replica that last ran the deepest of these blocks (None: no block known)."""
        for block_hash in reversed(hashes):
            engine = self._prefix_engine.get(block_hash)
            if engine is not None:
                return engine
        return None
