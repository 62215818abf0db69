"""Adapters read from disk off the step's thread: the worker's loader, and the engine's gate.

Reading a PEFT directory (``load_adapter``: its JSON, its header, every tensor) takes milliseconds
to seconds; on the step's thread it would stall every request of the step. So each worker reads
on a thread of its own, and the engine lets a request reach the scheduler only once its adapter
is on the host of every rank::

    EngineCore.add_request --(adapter not loaded)--> LoRALoadGate: request parked,
        every rank: Worker.add_lora -> AdapterLoader.start -> load_adapter on the loader thread
    EngineCore.step -> LoRALoadGate.poll: ranks asked which adapters are in, which failed ->
        loaded: its parked requests go to the scheduler; failed: its requests fail, with the error
        (naming the adapter's path); the other requests never wait for either

A step then finds the adapter in the host LRU (``AdapterLoader.get``) and only copies it into a
slot. vLLM reads an adapter on the step's thread when a step first needs it; this keeps it off.
The LRU (``max_cpu_loras``) never drops an adapter whose requests are still parked, so every
parked request is released (the LRU holds more meanwhile). The one remaining read on the step's
thread is an adapter dropped after its requests were released but before they were scheduled
(they wait in the scheduler, for max_loras or memory, while more than ``max_cpu_loras`` others
load): ``get`` reads it again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.peft import AdapterWeights, load_adapter
from pagedllm.lora.request import LoRARequest

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from pagedllm.core.request import Request

# Longest wait (s) for a load when the engine has nothing else to run (``LoRALoadGate.poll``):
# short, so that a request arriving meanwhile is not held back.
IDLE_WAIT_S = 0.01


class AdapterLoader:
    """A worker's adapters on the host: read on a loader thread, kept in an LRU of
    ``max_cpu_loras``. Every method runs on the worker's (step's) thread; the loader thread only
    runs ``load_adapter``."""

    def __init__(self, hf_config: PretrainedConfig, lora_config: LoRAConfig) -> None:
        self.hf_config = hf_config
        self.lora_config = lora_config
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-loader")
        self._known: dict[int, LoRARequest] = {}
        self._loading: dict[int, Future[AdapterWeights]] = {}
        # Loads that failed, with why, until ``states`` reports them.
        self._failed: dict[int, str] = {}
        # Adapter id -> its tensors, least recently used first.
        self._cache: OrderedDict[int, AdapterWeights] = OrderedDict()

    def start(self, lora_request: LoRARequest) -> None:
        """Start reading the adapter unless it is loaded or loading."""
        lora_int_id = lora_request.lora_int_id
        self._known[lora_int_id] = lora_request
        if lora_int_id in self._cache or lora_int_id in self._loading:
            return
        self._failed.pop(lora_int_id, None)
        self._loading[lora_int_id] = self._pool.submit(
            load_adapter, lora_request, self.hf_config, self.lora_config
        )

    def states(self, lora_int_ids: Iterable[int], timeout: float = 0.0) -> tuple[set[int], dict[int, str]]:
        """(the adapters among ``lora_int_ids`` on the host, those whose load failed with why);
        the rest are loading. Waits up to ``timeout`` s for one of theirs to finish."""
        ids = set(lora_int_ids)
        pending = [self._loading[i] for i in ids if i in self._loading]
        if pending and timeout > 0:
            wait(pending, timeout, return_when=FIRST_COMPLETED)
        # The adapters asked about are kept: their requests are about to be scheduled.
        self._collect(protected=ids)
        failed = {i: self._failed.pop(i) for i in ids if i in self._failed}
        return {i for i in ids if i in self._cache}, failed

    def get(self, lora_int_id: int) -> AdapterWeights:
        """The adapter's tensors, from the LRU; a load in flight is waited for, and an adapter the
        LRU dropped is read again (on this thread). Evicts nothing but to make room for this one:
        the step's other adapters, released by the same ``states`` call, stay."""
        weights = self._cache.get(lora_int_id)
        if weights is not None:
            self._cache.move_to_end(lora_int_id)
            return weights
        future = self._loading.pop(lora_int_id, None)
        if future is not None:
            weights = future.result()
        else:
            lora_request = self._known.get(lora_int_id)
            if lora_request is None:
                raise RuntimeError(f"no adapter with lora_int_id {lora_int_id} was sent to this worker")
            weights = load_adapter(lora_request, self.hf_config, self.lora_config)
        self._insert(lora_int_id, weights, protected={lora_int_id})
        return weights

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _collect(self, protected: set[int]) -> None:
        """Move finished loads into the LRU, or into ``_failed``."""
        for lora_int_id, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[lora_int_id]
            error = future.exception()
            if error is None:
                self._insert(lora_int_id, future.result(), protected)
            else:
                self._failed[lora_int_id] = _describe(self._known[lora_int_id], error)

    def _insert(self, lora_int_id: int, weights: AdapterWeights, protected: set[int]) -> None:
        """Add to the LRU, dropping the least recently used adapters past ``max_cpu_loras``
        except ``protected`` ones (the LRU may then hold more, until they are no longer)."""
        self._cache[lora_int_id] = weights
        evictable = [i for i in self._cache if i not in protected]
        for victim in evictable[: max(0, len(self._cache) - self.lora_config.num_cpu_loras)]:
            del self._cache[victim]


def _describe(lora_request: LoRARequest, error: BaseException) -> str:
    """The error of a failed load, naming the adapter (``check_adapter``'s ValueErrors do)."""
    if isinstance(error, ValueError):
        return str(error)
    where = f"adapter {lora_request.lora_name!r} ({lora_request.lora_path})"
    return f"{where} cannot be loaded: {type(error).__name__}: {error}"


# (worker method, args) -> every rank's answer: the executor's collective_rpc.
CollectiveRpc = Callable[..., list[Any]]


class LoRALoadGate:
    """The engine's side: requests whose adapter is not yet on every rank's host wait here, not in
    the scheduler (so the scheduler never schedules them, and nothing else waits for them).

    Args:
        collective_rpc: calls a worker method on every rank (``Worker.add_lora``,
            ``Worker.lora_load_states``) and returns their answers.
    """

    def __init__(self, collective_rpc: CollectiveRpc) -> None:
        self._rpc = collective_rpc
        # Adapter id -> the requests waiting for it, in arrival order.
        self._parked: dict[int, list[Request]] = {}

    def admit(self, request: Request) -> bool:
        """True when the request can go to the scheduler now; else it waits here for its
        adapter (whose load every rank starts)."""
        lora_request = request.group.lora_request
        if lora_request is None:
            return True
        lora_int_id = lora_request.lora_int_id
        if lora_int_id in self._parked:
            self._parked[lora_int_id].append(request)
            return False
        if all(self._rpc("add_lora", (lora_request,))):
            return True
        self._parked[lora_int_id] = [request]
        return False

    def poll(self, idle: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        """(requests whose adapter is now on every rank, in arrival order; requests whose adapter
        failed to load, with why). ``idle``: nothing else can run, so wait a little for a load."""
        if not self._parked:
            return [], []
        timeout = IDLE_WAIT_S if idle else 0.0
        answers = self._rpc("lora_load_states", (list(self._parked), timeout))
        loaded = set.intersection(*(ids for ids, _ in answers))
        failed: dict[int, str] = {}
        for _, errors in answers:
            failed.update(errors)
        ready, bad = [], []
        for lora_int_id in list(self._parked):
            if lora_int_id in failed:
                bad += [(r, failed[lora_int_id]) for r in self._parked.pop(lora_int_id)]
            elif lora_int_id in loaded:
                ready += self._parked.pop(lora_int_id)
        return sorted(ready, key=lambda r: r.req_id), bad

    def discard(self, requests: Iterable[Request]) -> None:
        """Forget parked requests (aborted)."""
        for request in requests:
            parked = self._parked.get(request.group.lora_int_id, [])
            if request in parked:
                parked.remove(request)

    def has_parked(self) -> bool:
        return any(self._parked.values())
