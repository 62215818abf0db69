"""The device's measured ceilings that the floors of the workloads are computed against."""

from __future__ import annotations

import torch


def copy_bandwidth(num_bytes: int = 1 << 30) -> float:
    """Device copy bandwidth, bytes read + written per second (median of do_bench)."""
    import triton.testing

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * num_bytes / (ms * 1e-3)


def matmul_peak_flops(size: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of one ``size``-cubed matmul (median of do_bench): the prefill ceiling."""
    import triton.testing

    a = torch.randn(size, size, dtype=dtype, device="cuda")
    b = torch.randn(size, size, dtype=dtype, device="cuda")
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return 2 * size**3 / (ms * 1e-3)
