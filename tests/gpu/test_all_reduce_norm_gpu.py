"""The all-reduce fused with the residual add and RMSNorm (kernels/triton/all_reduce_norm.py) on
two GPUs, against the unfused path, and the engine's tensor-parallel layers through it.

Each rank's partial rows are drawn from a generator seeded by its rank (integers: their sum is
exact), the residual and weight from a shared seed, so each rank computes the expected results
itself: the sum rounded to the dtype, plus the residual (``residual``: bit for bit), then
rms_norm.py's kernel over that (``out``: its own order of summing the squares, so within an ulp
of it in bfloat16, a few in float32).
Both ranks must hold bit-identical results.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_symm_mem_all_reduce_gpu import free_port

pytestmark = [
    pytest.mark.two_gpus,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

WORLD_SIZE = 2
# (rows, hidden, dtype): decode sizes, more rows than programs (each program loops), hidden sizes
# that are not powers of two, a tiny one, the widest, and float32 (the oracle's dtype in the tests).
CASES = [
    (1, 4096, torch.bfloat16),
    (3, 4096, torch.bfloat16),
    (64, 4096, torch.bfloat16),
    (130, 5120, torch.bfloat16),
    (7, 128, torch.bfloat16),
    (2, 16384, torch.bfloat16),
    (5, 4096, torch.float32),
    (200, 1000, torch.float32),
]
EPS = 1e-5


def inputs(rank: int, rows: int, hidden: int, dtype: torch.dtype, step: int = 0):
    partial = torch.randint(
        -8, 8, (rows, hidden), generator=torch.Generator().manual_seed(1000 * step + rank)
    )
    shared = torch.Generator().manual_seed(7 + step)
    residual = torch.randn(rows, hidden, generator=shared)
    weight = torch.rand(hidden, generator=shared) + 0.5
    return partial.to(dtype), residual.to(dtype), weight.to(dtype)


def expected(rows: int, hidden: int, dtype: torch.dtype, device: torch.device, step: int = 0):
    from pagedllm.kernels.triton.rms_norm import fused_add_rms_norm

    total = sum(inputs(r, rows, hidden, torch.float32, step)[0] for r in range(WORLD_SIZE)).to(dtype)
    _, residual, weight = inputs(0, rows, hidden, dtype, step)
    out, s = fused_add_rms_norm(total.to(device), residual.to(device), weight.to(device), EPS)
    return out.cpu(), s.cpu()


def _run_rank(rank: int, port: int, results: dict) -> None:
    from pagedllm.distributed import (
        destroy_distributed_environment,
        get_symm_mem_all_reduce,
        init_distributed_environment,
    )
    from pagedllm.kernels.triton.all_reduce_norm import all_reduce_add_rms_norm

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_distributed_environment(WORLD_SIZE, rank, f"tcp://127.0.0.1:{port}", device)
    failures = []

    def fused(x, residual, weight):
        comm = get_symm_mem_all_reduce()
        return all_reduce_add_rms_norm(
            x, residual, weight, EPS, comm.peer_buffers, comm.flag_offset, comm.rank
        )

    def check(name, got, want_out, want_residual):
        out, s = (t.cpu() for t in got)
        if not torch.equal(s, want_residual):
            failures.append(f"{name}: residual stream differs")
        ulps = 1 if out.dtype == torch.bfloat16 else 8
        tolerance = ulps * torch.finfo(out.dtype).eps * want_out.abs().float().clamp_min(1.0)
        if not ((out.float() - want_out.float()).abs() <= tolerance).all():
            failures.append(f"{name}: normalized output off by more than {ulps} ulp(s)")
        both = [None] * WORLD_SIZE
        dist.all_gather_object(both, (out, s))
        if not all(torch.equal(o, out) and torch.equal(r, s) for o, r in both):
            failures.append(f"{name}: ranks disagree")

    try:
        comm = get_symm_mem_all_reduce()
        if comm is None:
            failures.append("the symmetric-memory communicator did not start")
            return
        for rows, hidden, dtype in CASES:
            x, residual, weight = (t.to(device) for t in inputs(rank, rows, hidden, dtype))
            check(
                f"{rows}x{hidden} {dtype}", fused(x, residual, weight), *expected(rows, hidden, dtype, device)
            )

        # Back to back, alternating with the one-shot all-reduce on the same buffer: neither may
        # overwrite its buffer while a peer still reads the previous message (closing barriers).
        from pagedllm.distributed import tensor_model_parallel_all_reduce

        for step in range(100):
            x, residual, weight = (t.to(device) for t in inputs(rank, 4, 4096, torch.bfloat16, step))
            got = fused(x, residual, weight)
            tensor_model_parallel_all_reduce(torch.ones(4096, dtype=torch.bfloat16, device=device))
            _, s = expected(4, 4096, torch.bfloat16, device, step)
            if not torch.equal(got[1].cpu(), s):
                failures.append(f"back-to-back step {step} wrong")
                break

        # Captured in a CUDA graph (twice in a row, as two layers do) and replayed on new inputs.
        static = [
            torch.zeros(shape, dtype=torch.bfloat16, device=device) for shape in ((2, 4096), (2, 4096), 4096)
        ]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fused(static[0].clone(), static[1].clone(), static[2])  # warm-up outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            x1, r1 = fused(static[0].clone(), static[1].clone(), static[2])
            graph_out = fused(x1 * 0, r1.clone(), static[2])  # adds nothing: the same stream again
        for step in range(5):
            x, residual, weight = inputs(rank, 2, 4096, torch.bfloat16, step)
            for buffer, value in zip(static, (x, residual, weight)):
                buffer.copy_(value)
            graph.replay()
            check(f"graph replay {step}", graph_out, *expected(2, 4096, torch.bfloat16, device, step))
        torch.cuda.synchronize()
    finally:
        destroy_distributed_environment()
        results[rank] = failures


def test_fused_all_reduce_norm_matches_the_unfused_path_on_both_ranks():
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_run_rank, args=(free_port(), results), nprocs=WORLD_SIZE, join=True)
        assert dict(results) == {0: [], 1: []}
