"""The one-shot all-reduce over symmetric memory on two GPUs, against the exact sum.

Each rank's input is drawn from a generator seeded by its rank, so every rank can compute the
expected sum of both itself. Float32 inputs are integers, whose sums are exact; bfloat16 sums are
compared with the float32 sum rounded to bfloat16 (one addition of two bfloat16 values rounds
once). Both ranks must also hold bit-identical results: they sample the same tokens from them.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.two_gpus,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

WORLD_SIZE = 2
# (numel, dtype, storage offset of the input): decode-size messages, sizes that are not a multiple
# of the 16-byte vector, inputs at odd offsets (copied in by a separate kernel), one too small for
# the kernel (2 bytes: NCCL) and one past the one-shot limit (NCCL).
CASES = [
    (4096, torch.bfloat16, 0),
    (4096, torch.float32, 0),
    (6, torch.bfloat16, 0),
    (3 * 4096 + 2, torch.bfloat16, 0),
    (4096, torch.bfloat16, 1),
    (4096, torch.float32, 3),
    (1, torch.bfloat16, 0),
    (64 * 4096, torch.bfloat16, 0),
    (1024 * 1024, torch.float32, 0),
    (4 * 1024 * 1024, torch.bfloat16, 0),
]


def rank_input(rank: int, numel: int, dtype: torch.dtype, step: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(-64, 64, (numel,), generator=generator).to(dtype)


def expected_sum(numel: int, dtype: torch.dtype, step: int = 0) -> torch.Tensor:
    total = sum(rank_input(r, numel, torch.float32, step) for r in range(WORLD_SIZE))
    return total.to(dtype)


def _run_rank(rank: int, port: int, results: dict) -> None:
    from pagedllm.distributed import (
        destroy_distributed_environment,
        init_distributed_environment,
        tensor_model_parallel_all_reduce,
        uses_custom_all_reduce,
    )

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_distributed_environment(WORLD_SIZE, rank, f"tcp://127.0.0.1:{port}", device)
    failures = []
    try:
        if not uses_custom_all_reduce():
            failures.append("the one-shot all-reduce did not start")
        for numel, dtype, offset in CASES:
            storage = torch.zeros(offset + numel, dtype=dtype, device=device)
            x = storage[offset:]
            x.copy_(rank_input(rank, numel, dtype))
            out = tensor_model_parallel_all_reduce(x).cpu()
            if not torch.equal(out, expected_sum(numel, dtype)):
                failures.append(f"wrong sum for {numel} x {dtype} at offset {offset}")
            others = [torch.empty_like(out) for _ in range(WORLD_SIZE)]
            dist.all_gather_object(others, out)
            if not all(torch.equal(o, out) for o in others):
                failures.append(f"ranks disagree for {numel} x {dtype}")

        # Back to back with new values each time: a rank must not overwrite its buffer while a
        # peer still reads the previous message (the kernel's closing barrier).
        numel = 4096
        inputs = [rank_input(rank, numel, torch.bfloat16, step).to(device) for step in range(200)]
        outs = [tensor_model_parallel_all_reduce(x.clone()) for x in inputs]
        for step, out in enumerate(outs):
            if not torch.equal(out.cpu(), expected_sum(numel, torch.bfloat16, step)):
                failures.append(f"back-to-back step {step} wrong")
                break

        # Captured in a CUDA graph and replayed on new inputs, as the decode step runs it.
        static_in = torch.zeros(numel, dtype=torch.bfloat16, device=device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            tensor_model_parallel_all_reduce(static_in.clone())  # warm-up outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = tensor_model_parallel_all_reduce(tensor_model_parallel_all_reduce(static_in * 1) * 1)
        for step in range(5):
            static_in.copy_(rank_input(rank, numel, torch.bfloat16, step))
            graph.replay()
            twice = expected_sum(numel, torch.float32, step) * WORLD_SIZE
            if not torch.equal(static_out.cpu(), twice.to(torch.bfloat16)):
                failures.append(f"graph replay {step} wrong")
        torch.cuda.synchronize()
    finally:
        destroy_distributed_environment()
    results[rank] = failures


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_shot_all_reduce_sums_exactly_and_identically_on_both_ranks():
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_run_rank, args=(free_port(), results), nprocs=WORLD_SIZE, join=True)
        assert dict(results) == {0: [], 1: []}
