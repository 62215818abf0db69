"""All-reduce latency on two GPUs: NCCL against the one-shot kernel over symmetric memory
(``pagedllm/distributed/symm_mem.py``), in bfloat16, from one token of an 8B model (8 KiB) to
large prefill messages. It sets ``DEFAULT_MAX_BYTES``, where the one-shot kernel stops winning.
Then, at decode sizes (rows of Llama-3.1-8B's 4,096), what a decoder layer's block boundary costs:
the one-shot all-reduce followed by the residual add and RMSNorm (two kernels, as before
``RMSNorm.reduce_partial_input``) against the one kernel that fuses them
(``kernels/triton/all_reduce_norm.py``) at its default launch and at other warp counts.

    python benchmarks/all_reduce.py [--output-json F]

Each side is captured in a CUDA graph of 64 back-to-back all-reduces (a decode step's count for a
32-layer model) and replayed; CUDA events around each replay, 5 replays after 3 of warm-up,
median; microseconds per all-reduce, as rank 0 sees them.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES_BYTES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20]
FUSED_ROWS = [1, 8, 64, 256]
HIDDEN = 4096
CALLS_PER_GRAPH = 64


def _time_us(fn) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    for _ in range(3):
        graph.replay()
    figures = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        figures.append(start.elapsed_time(end) * 1000 / CALLS_PER_GRAPH)
    return statistics.median(figures)


def _block_boundary_us(one_shot, num_rows: int, device: torch.device) -> dict[str, float]:
    """us per block boundary: one-shot all-reduce then fused_add_rms_norm, and the fused kernel."""
    from pagedllm.kernels.triton.all_reduce_norm import all_reduce_add_rms_norm
    from pagedllm.kernels.triton.rms_norm import fused_add_rms_norm

    x = torch.randn(num_rows, HIDDEN, dtype=torch.bfloat16, device=device)
    residual, weight = torch.randn_like(x), torch.ones(HIDDEN, dtype=torch.bfloat16, device=device)
    args = (weight, 1e-5, one_shot.peer_buffers, one_shot.flag_offset, one_shot.rank)
    figures = {
        "unfused_us": _time_us(lambda: fused_add_rms_norm(one_shot.all_reduce(x), residual, weight, 1e-5))
    }
    figures["fused_us"] = _time_us(lambda: all_reduce_add_rms_norm(x, residual, *args))
    for warps in (4, 8, 16):
        figures[f"fused_{warps}_warps_us"] = _time_us(
            lambda warps=warps: all_reduce_add_rms_norm(x, residual, *args, num_warps=warps)
        )
    return figures


def _run_rank(rank: int, world_size: int, port: int, results: dict) -> None:
    from pagedllm.distributed import destroy_distributed_environment, init_distributed_environment
    from pagedllm.distributed.symm_mem import SymmMemAllReduce

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}", device, custom_all_reduce=False)
    one_shot = SymmMemAllReduce(dist.group.WORLD, device, max_bytes=max(SIZES_BYTES))
    rows = []
    for nbytes in SIZES_BYTES:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
        nccl_us = _time_us(lambda x=x: dist.all_reduce(x))
        one_shot_us = _time_us(lambda x=x: one_shot.all_reduce(x))
        rows.append({"bytes": nbytes, "nccl_us": nccl_us, "one_shot_us": one_shot_us})
    fused_rows = []
    for num_rows in FUSED_ROWS:
        fused_rows.append({"rows": num_rows, **_block_boundary_us(one_shot, num_rows, device)})
    if rank == 0:
        results["rows"] = rows
        results["fused"] = fused_rows
        results["device"] = torch.cuda.get_device_name(device)
    destroy_distributed_environment()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_run_rank, args=(args.world_size, port, results), nprocs=args.world_size, join=True)
        report = dict(results)
    print(
        f"all-reduce, bfloat16, {args.world_size} x {report['device']}, "
        f"us per call (CUDA graph of {CALLS_PER_GRAPH})"
    )
    print(f"{'bytes':>10} {'NCCL':>8} {'one-shot':>9} {'ratio':>6}")
    for row in report["rows"]:
        ratio = row["nccl_us"] / row["one_shot_us"]
        print(f"{row['bytes']:>10} {row['nccl_us']:>8.1f} {row['one_shot_us']:>9.1f} {ratio:>6.2f}")
    print(f"block boundary at decode sizes (rows of {HIDDEN}): all-reduce + add + RMSNorm, us per call")
    for row in report["fused"]:
        print(
            "  " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
        )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"world_size": args.world_size, **report}, indent=2))


if __name__ == "__main__":
    main()
