"""Activations of gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu.build import available as cpu_kernels_available
from pagedllm.layers.utils import use_triton


class SiluAndMul(nn.Module):
    """SwiGLU's gate: ``silu(gate) * up`` for ``x = [gate | up]`` (MergedColumnParallelLinear's output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * d] -> [num_tokens, d]."""
        if use_triton(x):
            return self.forward_triton(x)
        if self._cpu_kernel_applies(x):
            return self.forward_cpu(x)
        return self.forward_torch(x)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The reference path (any device)."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]).mul_(x[..., d:])

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """The C++ kernel (kernels/cpu/csrc/activation.cpp): one call instead of three operators."""
        from pagedllm.kernels.cpu.ops import silu_and_mul

        return silu_and_mul(x.view(-1, x.shape[-1])).view(*x.shape[:-1], x.shape[-1] // 2)

    def _cpu_kernel_applies(self, x: torch.Tensor) -> bool:
        # bf16 only, as RMSNorm: its exponential is not torch's, so a float32 result may differ
        # in the last bit, and float32 is the oracle's dtype; in bf16 only a rounding tie moves.
        return (
            x.device.type == "cpu"
            and x.dtype == torch.bfloat16
            and x.stride(-1) == 1
            and not torch.compiler.is_compiling()
            and cpu_kernels_available()
        )

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
