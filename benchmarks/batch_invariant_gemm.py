"""The batch-invariant GEMM (kernels/triton/batch_invariant_matmul.py) against cuBLAS (``F.linear``)
at the layer shapes of W1 (Qwen3-0.6B) and W3 (Llama-3.1-8B), bf16, for the row counts a step
sees: 1 (W3's decode), 64 and 256 (W1's decode batches), 2,048 (a prefill chunk).

    PYTHONPATH=. python benchmarks/batch_invariant_gemm.py [--sweep] [--output-json F]

``--splits-sweep``: for the default tiles, every layer at every row count with each candidate K split
count and each schedule (split in the grid or in the program), to choose ``num_k_splits``' rule and
the schedule's (both may change: neither moves the numerics with M).

``--wide``: every layer from 64 to 8,192 rows with the narrow tiles, the engine's choice
(``LayerGemm``: wide output tiles from a full wave of them) and each candidate in
``WIDE_CANDIDATES`` (the layer's BLOCK_K, other output tiles), each checked to give the narrow
tiles' bits. ``--few-rows``: the same from 1 to 256 rows with ``FEW_ROWS_CANDIDATES``. Either
exits non-zero if any candidate's bits differ.

``--sweep``: the same for other candidate tile configurations (``SWEEP``), each summarised by the
geometric mean of its speedups over cuBLAS. Without it, each layer runs the tiles the engine gives
it (``tiles_for``: from its K, never from M, since the tiles set the numerics); the sweep is how
that rule was chosen.

Each figure is the device time of one call replayed from a captured CUDA graph (what a decode
step runs), median of 5 repeats of 50 calls; GB/s counts the weight, activations and output once,
TFLOP/s ``2 M N K``. The ratio is cuBLAS's time over ours (above 1: ours is faster).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.kernels.bench import graph_median_us
from pagedllm.kernels.triton.batch_invariant_matmul import (
    TILES,
    LayerGemm,
    MatmulTiles,
    batch_invariant_matmul,
    num_k_splits,
    tiles_for,
)
from pagedllm.kernels.triton.split_k import num_sms

# (model, layer): (N, K) of one rank's weight.
LAYERS = {
    ("Qwen3-0.6B", "qkv_proj"): (4096, 1024),
    ("Qwen3-0.6B", "o_proj"): (1024, 2048),
    ("Qwen3-0.6B", "gate_up_proj"): (6144, 1024),
    ("Qwen3-0.6B", "down_proj"): (1024, 3072),
    ("Qwen3-0.6B", "lm_head"): (151_936, 1024),
    ("Llama-3.1-8B", "qkv_proj"): (6144, 4096),
    ("Llama-3.1-8B", "o_proj"): (4096, 4096),
    ("Llama-3.1-8B", "gate_up_proj"): (28_672, 4096),
    ("Llama-3.1-8B", "down_proj"): (4096, 14_336),
    ("Llama-3.1-8B", "lm_head"): (128_256, 4096),
}
ROWS = (1, 64, 256, 2048)
# Candidate tiles (block_m, block_n, block_k, num_warps, num_stages); all fit Hopper's shared memory.
SWEEP = [
    MatmulTiles(64, 128, 64, 4, 3),
    MatmulTiles(64, 128, 64, 4, 4),
    MatmulTiles(64, 128, 64, 4, 5),
    MatmulTiles(64, 64, 64, 4, 4),
    MatmulTiles(64, 64, 64, 4, 6),
    MatmulTiles(64, 128, 128, 4, 3),
    MatmulTiles(64, 128, 128, 4, 4),
    MatmulTiles(64, 256, 64, 8, 3),
    MatmulTiles(64, 256, 64, 8, 4),
    MatmulTiles(128, 128, 64, 8, 3),
    MatmulTiles(128, 256, 64, 8, 3),
]


def _graph_us(fn, calls: int = 50) -> float:
    """Device microseconds per call, replayed from a CUDA graph of ``calls`` calls."""
    return graph_median_us([fn] * calls)


def measure(n: int, k: int, m: int, device: torch.device, tiles: MatmulTiles | None = None) -> dict:
    """One layer at ``m`` rows, with ``tiles`` (default: the engine's, ``tiles_for``)."""
    tiles = tiles or tiles_for(k, device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
    splits = num_k_splits(n, k, num_sms(device), tiles)
    ours = _graph_us(lambda: batch_invariant_matmul(x, weight, None, splits, tiles))
    cublas = _graph_us(lambda: F.linear(x, weight))
    num_bytes = 2 * (n * k + m * k + m * n)
    return {
        "n": n,
        "k": k,
        "m": m,
        "num_splits": splits,
        "invariant_us": ours,
        "cublas_us": cublas,
        "invariant_gbps": num_bytes / ours / 1e3,
        "invariant_tflops": 2 * m * n * k / ours / 1e6,
        "speedup_vs_cublas": cublas / ours,
    }


# Output tiles tried for many rows, per BLOCK_K (the layer's, so that every candidate gives the
# narrow tiles' bits: checked on every call of the sweep).
WIDE_CANDIDATES = {
    64: [
        MatmulTiles(128, 256, 64, 8, 3),
        MatmulTiles(128, 128, 64, 8, 3),
        MatmulTiles(128, 128, 64, 8, 4),
        MatmulTiles(128, 128, 64, 4, 4),
        MatmulTiles(256, 128, 64, 8, 3),
    ],
    128: [
        MatmulTiles(128, 256, 128, 8, 2),
        MatmulTiles(128, 128, 128, 8, 3),
        MatmulTiles(128, 128, 128, 4, 3),
    ],
}
WIDE_ROWS = (64, 256, 512, 1024, 2048, 4096, 8192, 16_384)
# Output tiles tried for few rows (a decode step), per BLOCK_K: narrower N tiles make more
# programs for a memory-bound product that the layer's narrow tiles leave SMs idle on.
FEW_ROWS_CANDIDATES = {
    64: [MatmulTiles(64, 64, 64, 4, 4), MatmulTiles(64, 64, 64, 4, 6), MatmulTiles(64, 32, 64, 4, 6)],
    128: [MatmulTiles(64, 64, 128, 4, 4), MatmulTiles(64, 64, 128, 4, 5), MatmulTiles(64, 32, 128, 4, 6)],
}
FEW_ROWS = (1, 8, 32, 64, 128, 256)


def tile_sweep(
    device: torch.device, candidates: dict[int, list[MatmulTiles]], row_counts: tuple[int, ...]
) -> list[dict]:
    """Each layer x row count: the narrow tiles, the engine's choice, each candidate of the layer's
    BLOCK_K and cuBLAS, and whether each candidate's output equals the narrow tiles' bit for bit
    (it must, for the engine to take it). Prints one line per (layer, rows)."""
    rows = []
    for (model, layer), (n, k) in LAYERS.items():
        gemm = LayerGemm.for_layer(n, k, device)
        x_all = torch.randn(max(row_counts), k, device=device, dtype=torch.bfloat16)
        weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        for m in row_counts:
            x = x_all[:m]
            narrow_out = batch_invariant_matmul(x, weight, None, gemm.num_splits, gemm.tiles)
            narrow = _graph_us(
                functools.partial(batch_invariant_matmul, x, weight, None, gemm.num_splits, gemm.tiles)
            )
            cublas = _graph_us(functools.partial(F.linear, x, weight))
            engine = _graph_us(functools.partial(gemm, x, weight, None))
            runs = []
            for tiles in candidates[gemm.tiles.block_k]:
                call = functools.partial(batch_invariant_matmul, x, weight, None, gemm.num_splits, tiles)
                same = torch.equal(call(), narrow_out)
                runs.append({"tiles": str(tiles), "us": _graph_us(call), "same_bits": same})
            rows.append(
                {
                    "model": model,
                    "layer": layer,
                    "n": n,
                    "k": k,
                    "m": m,
                    "num_splits": gemm.num_splits,
                    "narrow_us": narrow,
                    "engine_us": engine,
                    "cublas_us": cublas,
                    "engine_tiles": str(gemm.tiles_for_rows(m)),
                    "runs": runs,
                }
            )
            print(
                f"{model} {layer} M={m}: cuBLAS {cublas:.1f}, narrow {narrow:.1f}, engine {engine:.1f} us; "
                + ", ".join(
                    f"{r['tiles'][11:].replace('block_', '').replace('num_', '')}: {r['us']:.1f}"
                    + ("" if r["same_bits"] else " DIFFERENT BITS")
                    for r in runs
                ),
                flush=True,
            )
    return rows


SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def splits_sweep(device: torch.device) -> list[dict]:
    """Each layer x row count x split count x schedule; prints the best per (layer, rows)."""
    rows = []
    for (model, layer), (n, k) in LAYERS.items():
        x_all = torch.randn(max(ROWS), k, device=device, dtype=torch.bfloat16)
        weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        for m in ROWS:
            x = x_all[:m]
            cublas = _graph_us(functools.partial(F.linear, x, weight))
            timed = []
            for splits in (s for s in SPLITS if s <= k // TILES.block_k):
                # In the grid only where its partials fit in a GiB.
                in_grid_fits = splits > 1 and 4 * splits * m * n <= 2**30
                for in_grid in (True, False) if in_grid_fits else (False,):
                    call = functools.partial(
                        batch_invariant_matmul, x, weight, None, splits, split_in_grid=in_grid
                    )
                    us = _graph_us(call)
                    timed.append({"splits": splits, "in_grid": in_grid, "us": us})
            rows.append(
                {"model": model, "layer": layer, "n": n, "k": k, "m": m, "cublas_us": cublas, "runs": timed}
            )
            best = min(timed, key=lambda r: r["us"])
            default = num_k_splits(n, k, num_sms(device))
            print(
                f"{model} {layer} M={m}: cuBLAS {cublas:.1f} us; best {best['us']:.1f} us at "
                f"{best['splits']} "
                f"splits {'in grid' if best['in_grid'] else 'in program'}; default {default} splits: "
                + ", ".join(
                    f"{r['us']:.1f}{'g' if r['in_grid'] else 'p'}" for r in timed if r["splits"] == default
                ),
                flush=True,
            )
    return rows


def table(tiles: MatmulTiles | None, device: torch.device) -> list[dict]:
    """Every layer at every row count, printed as it goes."""
    header = ("M", "splits", "ours us", "cuBLAS us", "GB/s", "TFLOP/s", "x")
    widths = (5, 6, 9, 9, 7, 8, 6)
    print(f"{tiles or 'tiles_for'}\n{'layer':<28} " + " ".join(f"{h:>{w}}" for h, w in zip(header, widths)))
    rows = []
    for (model, layer), (n, k) in LAYERS.items():
        for m in ROWS:
            row = {"model": model, "layer": layer, **measure(n, k, m, device, tiles)}
            rows.append(row)
            print(
                f"{model + ' ' + layer:<28} {m:>5} {row['num_splits']:>6} {row['invariant_us']:>9.1f} "
                f"{row['cublas_us']:>9.1f} {row['invariant_gbps']:>7.0f} {row['invariant_tflops']:>8.1f} "
                f"{row['speedup_vs_cublas']:>6.2f}"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also the candidate configurations in SWEEP")
    parser.add_argument("--splits-sweep", action="store_true", help="split counts and schedules (SPLITS)")
    parser.add_argument(
        "--wide", action="store_true", help="wide output tiles for many rows (WIDE_CANDIDATES)"
    )
    parser.add_argument(
        "--few-rows", action="store_true", help="narrower tiles for few rows (FEW_ROWS_CANDIDATES)"
    )
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    if args.splits_sweep or args.wide or args.few_rows:
        if args.splits_sweep:
            rows = splits_sweep(device)
        elif args.wide:
            rows = tile_sweep(device, WIDE_CANDIDATES, WIDE_ROWS)
        else:
            rows = tile_sweep(device, FEW_ROWS_CANDIDATES, FEW_ROWS)
        differing = [row for row in rows for run in row.get("runs", ()) if run.get("same_bits") is False]
        if args.output_json:
            Path(args.output_json).write_text(
                json.dumps({"device": torch.cuda.get_device_name(), "rows": rows})
            )
        if differing:  # an output tile the engine may take would change a row's bits with M
            sys.exit(f"{len(differing)} candidate runs gave other bits than the narrow tiles")
        return
    results = {}
    for tiles in [None] + (SWEEP if args.sweep else []):
        rows = table(tiles, device)
        speedups = [row["speedup_vs_cublas"] for row in rows]
        geomean = statistics.geometric_mean(speedups)
        print(f"{tiles or 'tiles_for'}: geometric mean speedup over cuBLAS {geomean:.3f}\n")
        results[str(tiles or "tiles_for")] = {"rows": rows, "geomean_speedup": geomean}
    if args.output_json:
        summary = {"device": torch.cuda.get_device_name(), "default": "tiles_for", "configs": results}
        Path(args.output_json).write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
