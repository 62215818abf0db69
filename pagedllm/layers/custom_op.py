"""CustomOp: a layer with one forward per implementation, one of them chosen for its device.

As vLLM's ``CustomOp``: the implementations are methods (``forward_torch``, the reference on any
device; ``forward_triton``; ``forward_cpu``, the C++ kernels), and ``dispatch_forward`` picks one
from the device's ``Platform`` and the layer's dtype. The choice is made when the layer is bound to
its device: at construction, which for the engine is final (the loader builds every model under
``torch.device(device)`` in its run dtype), and again whenever ``.to()``, ``.cuda()``, ``.half()``
or any other ``nn.Module._apply`` moves or casts the layer (tests and tools build on the CPU and
move). ``forward`` calls the chosen method, so a step tests neither device nor dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.platform import Platform, platform_for


class CustomOp(nn.Module):
    """Subclasses define ``forward`` as a call of ``self.forward_method`` with their own
    signature, ``forward_torch`` and the kernels' forwards, and ``dispatch_forward``.

    A subclass whose ``forward`` does nothing but that call sets ``forward_only_dispatches``: the
    chosen method then becomes the instance's ``forward`` itself, one call less per layer and step
    (the class's ``forward`` stays as the documented signature).
    """

    # The reference implementation, on any device.
    forward_torch: Callable[..., Any]
    # The implementation ``forward`` runs, chosen by ``dispatch_forward`` when bound to a device.
    forward_method: Callable[..., Any]
    forward_only_dispatches = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A subclass's own forward would be bypassed: the instance's forward is the chosen method.
        own = vars(cls)
        if cls.forward_only_dispatches and "forward" in own and "forward_only_dispatches" not in own:
            raise TypeError(
                f"{cls.__name__} overrides forward, which its base binds to the chosen forward "
                "(forward_only_dispatches): set forward_only_dispatches = False on it"
            )

    def __init__(self) -> None:
        super().__init__()
        # Where the layer's tensors are created: the default device and dtype (a parameter-free
        # layer has no tensor to ask).
        probe = torch.empty(0)
        self._bind(probe.device, probe.dtype)

    def dispatch_forward(self, platform: Platform, dtype: torch.dtype) -> Callable[..., Any]:
        """The forward to run on ``platform`` for activations of ``dtype``. Subclasses choose
        among their implementations; this default is the reference."""
        return self.forward_torch

    def _bind(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.forward_method = self.dispatch_forward(platform_for(device), dtype)
        if self.forward_only_dispatches:
            self.forward = self.forward_method

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> CustomOp:
        super()._apply(fn, recurse)
        # What the move or cast does to a tensor of this layer's device and dtype is where the
        # layer now is.
        moved = fn(torch.empty(0, device=self.device, dtype=self.dtype))
        self._bind(moved.device, moved.dtype)
        return self
