"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedllm.distributed import get_symm_mem_all_reduce, tensor_model_parallel_all_reduce
from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.build import available as cpu_kernels_available
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.utils import default_weight_loader
from pagedllm.platform import Platform

# What RMSNorm's implementations take and return (``RMSNorm.forward``).
RMSNormForward = Callable[
    [torch.Tensor, torch.Tensor | None], torch.Tensor | tuple[torch.Tensor, torch.Tensor]
]


class RMSNorm(CustomOp):
    """``weight * x / sqrt(mean(x^2) + eps)``, numerically as Hugging Face's LlamaRMSNorm.

    The statistics are computed in float32 and the result is cast back to the input dtype before
    the weight multiplies it: in bf16 that order changes the rounding, and matching it is what makes
    our logits equal the reference's.
    """

    forward_only_dispatches = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        # Whether x with a residual is this rank's partial sum, summed over the ranks here first
        # (reduce_partial_input).
        self.reduces_input = False
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def reduce_partial_input(self) -> None:
        """From now on, ``forward(x, residual)`` takes x as this tensor-parallel rank's partial sum
        (a row-parallel projection's, its all-reduce deferred) and sums it over the ranks before
        the residual add: on GPUs that share memory one kernel does the all-reduce, the add and
        the norm (kernels/triton/all_reduce_norm.py), else the all-reduce runs first. Without a
        residual, x is whole (the embedding's output) and is only normalized."""
        self.reduces_input = True
        self._bind(self.device, self.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., hidden_size]. With ``residual`` (same shape), normalizes ``x + residual`` and
        returns ``(out, x + residual)``, the residual stream the next block adds to.

        The results may reuse the buffers of ``x`` and ``residual`` (the fused kernel writes them in
        place): callers pass tensors they are done with, as the decoder layers do.
        """
        return self.forward_method(x, residual)

    def dispatch_forward(self, platform: Platform, dtype: torch.dtype) -> RMSNormForward:
        method = self._dispatch_local(platform, dtype)
        return _reducing(self, method, platform) if self.reduces_input else method

    def _dispatch_local(self, platform: Platform, dtype: torch.dtype) -> RMSNormForward:
        if platform.triton:
            return self.forward_triton
        # bf16 only. The kernel reduces the float32 sum of squares in another order than torch:
        # in float32, the oracle's dtype, that moves the last bit of ~1 in 4 results; in bf16 only
        # a result on a rounding tie moves (~3 in 100,000, by one bf16 ulp).
        if platform.cpu_kernels and dtype == torch.bfloat16 and cpu_kernels_available():
            return self.forward_cpu
        return self.forward_torch

    def forward_torch(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The reference path (any device); leaves its inputs unchanged."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward_triton(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One fused kernel; with ``residual``, the results are written over x and residual."""
        from pagedllm.kernels.triton.rms_norm import fused_add_rms_norm, rms_norm

        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The C++ kernel (kernels/cpu/csrc/rms_norm.cpp), one call instead of ~9 operators. As
        the Triton kernel's: with ``residual`` the results are written over x and residual;
        without, into a new tensor.

        The torch path instead for rows the kernel cannot read in place (a strided view: Qwen3's
        per-head norms of a fused QKV of several tokens), and inside torch.compile's graphs
        (cpu_compile), where inductor fuses the norm itself."""
        if (
            torch.compiler.is_compiling()
            or not x.is_contiguous()
            or (residual is not None and not residual.is_contiguous())
        ):
            return self.forward_torch(x, residual)
        hidden = x.shape[-1]
        out = x if residual is not None else x.clone()
        cpu_ops.rms_norm(
            out.view(-1, hidden),
            None if residual is None else residual.view(-1, hidden),
            self.weight,
            self.eps,
        )
        return out if residual is None else (out, residual)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        variance = x_fp32.pow(2).mean(-1, keepdim=True)
        normed = x_fp32 * torch.rsqrt(variance.add_(self.eps))
        # ``normed`` is a fresh tensor in every dtype (never ``x``), so scaling it in place is safe.
        return normed.to(x.dtype).mul_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _reducing(norm: RMSNorm, method: RMSNormForward, platform: Platform) -> RMSNormForward:
    """``method`` after the tensor-parallel sum of its partial input (RMSNorm.reduce_partial_input)."""
    # The fused kernel normalizes in Llama's order (Gemma's rounds differently).
    comm = get_symm_mem_all_reduce() if platform.triton and type(norm) is RMSNorm else None
    if comm is not None:
        from pagedllm.kernels.triton import all_reduce_norm

    def forward(
        x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return method(x, None)
        # Decided by the message's size and dtype alone: every rank takes the same path.
        if comm is not None and all_reduce_norm.takes(x) and comm.should_use(x):
            return all_reduce_norm.all_reduce_add_rms_norm(
                x, residual, norm.weight, norm.eps, comm.peer_buffers, comm.flag_offset, comm.rank
            )
        return method(tensor_model_parallel_all_reduce(x), residual)

    return forward


class GemmaRMSNorm(RMSNorm):
    """Gemma's ``(1 + weight) * x / sqrt(mean(x^2) + eps)``, as Hugging Face's GemmaRMSNorm (and
    Qwen3NextRMSNorm): the checkpoint stores the weight's offset from 1, and the product is taken in
    float32 before the cast back (Llama's casts first). The fused Triton kernel has this order too
    (``gemma=True``); the CPU's C++ kernel has Llama's only, so there the torch path runs."""

    def _dispatch_local(self, platform: Platform, dtype: torch.dtype) -> RMSNormForward:
        return self.forward_triton if platform.triton else self.forward_torch

    def forward_triton(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm's fused kernel, in Gemma's order."""
        from pagedllm.kernels.triton.rms_norm import fused_add_rms_norm, rms_norm

        if residual is None:
            return rms_norm(x, self.weight, self.eps, gemma=True)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, gemma=True)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
