"""The output tile a program of a 2-D GEMM grid owns, shared by the GEMM kernels (the batch-invariant
matmul and the quantized GEMMs): grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), ...)``, program
``(m, n)`` computes ``out[m * BLOCK_M : (m + 1) * BLOCK_M, n * BLOCK_N : (n + 1) * BLOCK_N]``."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def output_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's rows ``offs_m`` [BLOCK_M] and columns ``offs_n`` [BLOCK_N] of the output,
    the offsets ``offs_k`` [BLOCK_K] of a K tile, and the masks of the rows and columns that exist."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    return offs_m, offs_n, offs_k, mask_m, mask_n
