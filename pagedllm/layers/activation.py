"""Activations of gated MLPs, and gated attention's sigmoid output gate."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.custom_op import CustomOp
from pagedllm.platform import Platform


class SiluAndMul(CustomOp):
    """SwiGLU's gate: ``silu(gate) * up`` for ``x = [gate | up]`` (MergedColumnParallelLinear's output).

    It holds no tensor, so its device is the default device where it is built (the loader's
    ``torch.device``) or where ``.to()`` sends it."""

    forward_only_dispatches = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * d] -> [num_tokens, d]."""
        return self.forward_method(x)

    def dispatch_forward(
        self, platform: Platform, dtype: torch.dtype
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.forward_triton if platform.triton else self.forward_torch

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The reference path (any device)."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]).mul_(x[..., d:])

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        """One fused kernel: gate and up read once, the output written once."""
        from pagedllm.kernels.triton.activation import silu_and_mul

        return silu_and_mul(x)


class GeluAndMul(nn.Module):
    """GeGLU's gate with the tanh approximation (Gemma's ``gelu_pytorch_tanh``):
    ``gelu_tanh(gate) * up`` for ``x = [gate | up]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * d] -> [num_tokens, d]."""
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh").mul_(x[..., d:])


class SigmoidGate(CustomOp):
    """Gated attention's output gate (Qwen3-Next): ``x * sigmoid(gate)``, the sigmoid rounded to
    the activations' dtype before the product, as Hugging Face computes it.

    It holds no tensor, so its device is the default device where it is built or where ``.to()``
    sends it."""

    forward_only_dispatches = True

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [num_tokens, num_heads, head_size], head_size contiguous, any other strides (the
        gate a view of the q projection's output). Returns [num_tokens, num_heads * head_size]."""
        return self.forward_method(x, gate)

    def dispatch_forward(self, platform: Platform, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        return self.forward_triton if platform.triton else self.forward_torch

    def forward_torch(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The reference path (any device): a sigmoid kernel, then a product."""
        return (x * torch.sigmoid(gate)).view(x.shape[0], -1)

    def forward_triton(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """One fused kernel: x and the gate read in place once, the product written once (its last
        bit can differ from the reference's in rare elements: kernels/triton/sigmoid_gate.py)."""
        from pagedllm.kernels.triton.sigmoid_gate import sigmoid_gate

        return sigmoid_gate(x, gate)
