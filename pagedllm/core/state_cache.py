"""StateSlotPool: which slot of the recurrent-state cache each request of a hybrid model owns.

Linear-attention layers (Gated DeltaNet, Mamba-2) keep a fixed-size state per request instead of
a KV cache that grows with the context: a rolling window of the causal conv1d's last inputs and
the recurrent (SSM) state. The worker holds one tensor per layer with ``num_slots + 1`` rows
(``layers/linear_attention/state.py``); a request owns row ``slot`` from admission until it is
freed (finish, abort, preemption by recompute), and the last row is scratch that padding rows of
a CUDA graph write::

    request   7         12        3                     (running or swapped)
    slot      0         2         1         [3: free]   [4: scratch]
    per layer conv_state[slot]  [conv_dim, kernel - 1]
              ssm_state[slot]   [num_heads, head_v_dim, head_k_dim] (V-first)

A fork (``n``, ``best_of``, beams) takes a slot of its own, filled by the workers with a copy of
its parent's rows before the next forward pass (``KVCacheManager.fork``).

A slot is never cleared: a request whose step starts at position 0 reads no state (its kernels
take zeros), so a slot freed while a step in flight still writes it can go at once to the next
request, whose first write follows that step on the device's stream. A swapped-out request keeps
its slot (the state is small and stays on the device; only its KV blocks move).
"""

from __future__ import annotations


class StateSlotPool:
    """A free list of ``num_slots`` state slots, one per live request at most.

    Args:
        num_slots: rows of the worker's state tensors (without the scratch row).
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        # A stack: the most recently freed slot is reused first.
        self._free = list(reversed(range(num_slots)))
        self._slot_of: dict[int, int] = {}

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self, req_id: int) -> int:
        """The request's slot (a fresh one unless it holds one). Callers check ``can_allocate``."""
        slot = self._slot_of.get(req_id)
        if slot is None:
            if not self._free:
                raise RuntimeError(f"out of state slots ({self.num_slots} in all)")
            slot = self._slot_of[req_id] = self._free.pop()
        return slot

    def free(self, req_id: int) -> None:
        """Give the request's slot back (a no-op if it holds none)."""
        slot = self._slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def slot_of(self, req_id: int) -> int:
        return self._slot_of[req_id]

    def get_num_free_slots(self) -> int:
        return len(self._free)
