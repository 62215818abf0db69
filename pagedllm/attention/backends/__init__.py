"""Attention backends, each owning its KV cache layout (DESIGN.md section 5)."""

from __future__ import annotations

import torch

from pagedllm.attention.backends.abstract import AttentionBackend, KVCache


def get_attn_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    """The backend class for ``name``. 'auto' is the Triton kernels on a GPU (measured fastest:
    benchmarks/RESULTS.md) and the torch reference on the CPU."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from pagedllm.attention.backends.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend
    if name == "triton":
        from pagedllm.attention.backends.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend
    if name == "cuda":
        from pagedllm.attention.backends.cuda_backend import CudaAttentionBackend

        return CudaAttentionBackend
    raise ValueError(f"attention_backend must be one of 'auto', 'torch', 'triton', 'cuda', got {name!r}")


__all__ = ["AttentionBackend", "KVCache", "get_attn_backend"]
