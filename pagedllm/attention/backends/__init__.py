"""Attention backends, each owning its KV cache layout (DESIGN.md section 5)."""

from __future__ import annotations

import torch

from pagedllm.attention.backends.abstract import AttentionBackend, KVCache
from pagedllm.platform import platform_for


def get_attn_backend(
    name: str, device: torch.device, batch_invariant: bool = False, context_parallel: bool = False
) -> type[AttentionBackend]:
    """The backend class for ``name``. 'auto' is the Triton kernels on a GPU and the vectorised
    CPU backend on the CPU (each measured fastest there: benchmarks/RESULTS.md), or the torch
    backend on the CPU with ``context_parallel`` (a striped cache, which the CPU kernels do not
    read). With ``batch_invariant``, Triton's and the CPU's are their invariant variants (one
    kernel for every query); engine/batch_invariant.py refuses the others on CUDA."""
    if name == "auto":
        name = "triton" if platform_for(device).is_cuda() else "torch" if context_parallel else "cpu"
    if name == "triton" and batch_invariant:
        from pagedllm.attention.backends.triton_invariant_backend import TritonInvariantAttentionBackend

        return TritonInvariantAttentionBackend
    if name == "cpu":
        from pagedllm.attention.backends.cpu_backend import CpuAttentionBackend, CpuInvariantAttentionBackend

        return CpuInvariantAttentionBackend if batch_invariant else CpuAttentionBackend
    if name == "torch":
        from pagedllm.attention.backends.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend
    if name == "triton":
        from pagedllm.attention.backends.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend
    if name == "cuda":
        from pagedllm.attention.backends.cuda_backend import CudaAttentionBackend

        return CudaAttentionBackend
    raise ValueError(
        f"attention_backend must be one of 'auto', 'cpu', 'torch', 'triton', 'cuda', got {name!r}"
    )


__all__ = ["AttentionBackend", "KVCache", "get_attn_backend"]
