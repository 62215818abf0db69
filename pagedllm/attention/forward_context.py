"""The step a forward pass runs, as the layers inside it read it (vLLM's ``set_forward_context``).

A model's forward is ``forward(input_ids, positions)``: the two things that change per token.
What a layer needs besides those comes from one of two places, each set once where it changes:

* its KV cache, bound to the layer when the cache is allocated (``bind_kv_caches``: the
  ``layer.kv_cache = ...`` of vLLM's ``bind_kv_cache``); the recurrent state of a hybrid model's
  linear-attention layers likewise (worker/state_cache.py);
* the step's ``AttentionMetadata``, set around each forward pass by whoever runs it
  (``with set_forward_context(attn_metadata): model(input_ids, positions)``) and read by the
  attention layers and the state mixers (``get_forward_context()``).

So neither travels through the model files: a family's decoder reads as the paper's, and a
feature of the step (a new metadata field) touches the runner and the layer that reads it, not
every forward in between.

A context is one forward pass: what the pass derives from its metadata once for all of its layers
(a hybrid's decode state rows, its prefill plan) is memoised on it (``ForwardContext.once``) and
dies with it. A CUDA graph captures the forward under a context of its static metadata (views of
the input buffers the runner fills before each replay), its own, not its warm-up runs': a value
derived outside the capture would be a constant of every replay. A replay runs no Python, so no
context is read then.
A torch.compile'd forward reads no context in its graph: its attention op reads it when it runs
(attention/layer.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pagedllm.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class ForwardContext:
    """What the layers of the running forward pass read besides their inputs."""

    # The step's flattened batch: slots, block tables, sequence offsets and lengths.
    attn_metadata: AttentionMetadata
    # What the pass's layers derived from attn_metadata for each other, by name.
    derived: dict[str, Any] = field(default_factory=dict)

    def once(self, name: str, make: Callable[[], Any]) -> Any:
        """``make()`` the first time a layer of this pass asks for ``name``; its value after."""
        if name not in self.derived:
            self.derived[name] = make()
        return self.derived[name]


_forward_context: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata) -> Iterator[None]:
    """The context of the forward pass run inside the block; the enclosing one after it."""
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata)
    try:
        yield
    finally:
        _forward_context = previous


def get_forward_context() -> ForwardContext:
    """The context of the running forward pass (set_forward_context)."""
    if _forward_context is None:
        raise RuntimeError("no forward context: run the model inside set_forward_context(attn_metadata)")
    return _forward_context
