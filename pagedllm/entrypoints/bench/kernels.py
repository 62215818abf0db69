"""``pagedllm bench kernels``: decode attention bandwidth, benchmarks/README.md's K1.

For each context -- one length for every sequence, or a ragged range drawn with Python's
``random`` seeded as the workloads draw theirs -- each implementation of
``pagedllm.kernels.bench.DECODE_IMPLS`` runs at the launch parameters the engine uses, beside SDPA
on a contiguous cache and a copy of the same bytes (the ceiling). ``--sweep`` also times every
launch of each implementation's sweep space and reports the best per context, so that tuning
takes one call on the device. Prints a table last; writes every row as JSON (``--output-json``)
and a bar chart (``--output-png``).

Needs a CUDA device to run; parsing the arguments imports only torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pagedllm.entrypoints.bench import write_json
from pagedllm.kernels.bench import DECODE_IMPLS, DecodeResult, DecodeShape

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class ContextRange:
    """Context lengths drawn uniformly from ``[lo, hi]``; ``lo == hi`` is a uniform batch."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str) -> ContextRange:
        """'4096' (every sequence has 4096 tokens) or '1-8192' (each drawn from [1, 8192])."""
        lo, is_range, hi = text.partition("-")
        try:
            context = cls(int(lo), int(hi) if is_range else int(lo))
        except ValueError:
            raise argparse.ArgumentTypeError(f"context {text!r}: want LEN or LO-HI") from None
        if not 1 <= context.lo <= context.hi:
            raise argparse.ArgumentTypeError(f"context {text!r}: want 1 <= LO <= HI")
        return context

    @property
    def label(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"

    def seq_lens(self, batch_size: int, seed: int) -> tuple[int, ...]:
        """One length per sequence, from Python's ``random`` seeded with ``seed`` (benchmarks/README.md)."""
        rng = random.Random(seed)
        return tuple(rng.randint(self.lo, self.hi) for _ in range(batch_size))


# K1: three uniform contexts and the ragged batch.
K1_CONTEXTS = (
    ContextRange(512, 512),
    ContextRange(4096, 4096),
    ContextRange(16384, 16384),
    ContextRange(1, 8192),
)


def add_decode_batch_args(parser: argparse.ArgumentParser) -> None:
    """K1's decode batch, --contexts and --batch-size (also ``bench mla``'s)."""
    parser.add_argument(
        "--contexts",
        nargs="+",
        type=ContextRange.parse,
        default=list(K1_CONTEXTS),
        metavar="LEN|LO-HI",
        help="context lengths: LEN for a uniform batch, LO-HI for lengths drawn uniformly from [LO, HI]",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per decode step")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The K1 shape by default (benchmarks/README.md); every dimension can be changed."""
    add_decode_batch_args(parser)
    parser.add_argument("--num-heads", type=int, default=32, help="query heads")
    parser.add_argument("--num-kv-heads", type=int, default=8, help="key/value heads")
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8", "fp8_e4m3"],
        default="auto",
        help="auto: the cache in --dtype; fp8/fp8_e4m3: float8_e4m3fn with unit scales (the Triton "
        "kernel only; bandwidth counts the cache's bytes at one byte an element)",
    )
    parser.add_argument(
        "--implementations",
        nargs="+",
        choices=list(DECODE_IMPLS),
        default=[name for name, impl in DECODE_IMPLS.items() if impl.available],
        help="default: every implementation whose package is installed (FlashInfer is a peer)",
    )
    parser.add_argument(
        "--sweep", action="store_true", help="also time every launch of the sweep space; report the best"
    )
    parser.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="also time windowed decode (window-capable implementations, default launch) with this window",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the lengths and the random K/V")
    parser.add_argument("--output-json", help="write the report (every row) here")
    parser.add_argument("--output-png", help="draw achieved bandwidth per context here (needs matplotlib)")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the report written to --output-json."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("pagedllm bench kernels needs a CUDA device (and TRITON_INTERPRET unset)")
    import triton

    from pagedllm.kernels.bench import bench_decode

    kv_dtype = None if args.kv_cache_dtype == "auto" else torch.float8_e4m3fn
    implementations = [
        n for n in args.implementations if kv_dtype is None or DECODE_IMPLS[n].supports_fp8_cache
    ]
    if len(implementations) < len(args.implementations):
        skipped = sorted(set(args.implementations) - set(implementations))
        print(
            f"--kv-cache-dtype {args.kv_cache_dtype}: {skipped} read no FP8 cache, not timed", file=sys.stderr
        )
    rows = []
    for context in args.contexts:
        shape = DecodeShape(
            context.seq_lens(args.batch_size, args.seed),
            args.num_heads,
            args.num_kv_heads,
            args.head_size,
            args.block_size,
            DTYPES[args.dtype],
            kv_dtype=kv_dtype,
        )
        runs = {name: DECODE_IMPLS[name].launches(shape, args.sweep) for name in implementations}
        print(f"context {context.label}: {sum(map(len, runs.values()))} runs", file=sys.stderr, flush=True)
        for result in bench_decode(shape, runs, args.seed):
            rows.append(_row(context, result, is_default=result.launch == runs[result.implementation][0]))
        if args.sliding_window is not None:
            rows += _windowed_rows(context, shape, args, rows)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "config": _config(args),
        "rows": rows,
        "best": best_rows(rows) if args.sweep else [],
    }
    write_json(args.output_json, report, indent=2)
    if args.output_png:
        write_plot(report, args.output_png)
    print(format_table([row for row in rows if row["default_launch"]]))
    if args.sweep:
        print("\nbest launch per context (--sweep):")
        print(format_table(report["best"]))
    return report


def _windowed_rows(
    context: ContextRange, shape: DecodeShape, args: argparse.Namespace, rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The window-capable implementations' default launches with ``--sliding-window``, each with
    its speed-up over the same implementation unwindowed on the same context."""
    from pagedllm.kernels.bench import bench_decode

    windowed = dataclasses.replace(shape, sliding_window=args.sliding_window)
    names = [name for name in args.implementations if DECODE_IMPLS[name].supports_sliding_window]
    runs = {name: DECODE_IMPLS[name].launches(windowed, sweep=False) for name in names}
    unwindowed_ms = {
        row["implementation"]: row["median_ms"]
        for row in rows
        if row["context"] == context.label and row["default_launch"]
    }
    out = []
    for result in bench_decode(windowed, runs, args.seed):
        row = _row(context, result, is_default=True)
        row["implementation"] = f"{result.implementation} (window {args.sliding_window})"
        row["sliding_window"] = args.sliding_window
        if result.implementation in unwindowed_ms:
            row["speedup_vs_unwindowed"] = unwindowed_ms[result.implementation] / result.median_ms
        out.append(row)
    return out


def _row(context: ContextRange, result: DecodeResult, is_default: bool) -> dict[str, Any]:
    return {
        "context": context.label,
        "default_launch": is_default,
        **asdict(result),
        "fraction_of_copy": result.fraction_of_copy,
        "vs_sdpa": result.vs_sdpa,
    }


def _config(args: argparse.Namespace) -> dict[str, Any]:
    names = (
        "batch_size",
        "num_heads",
        "num_kv_heads",
        "head_size",
        "block_size",
        "dtype",
        "kv_cache_dtype",
        "sweep",
        "seed",
        "sliding_window",
    )
    return {
        "contexts": [context.label for context in args.contexts],
        **{name: getattr(args, name) for name in names},
    }


def best_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fastest row of each (implementation, context), in first-seen order."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["implementation"], row["context"])
        if key not in best or row["median_ms"] < best[key]["median_ms"]:
            best[key] = row
    return list(best.values())


def _launch_label(launch: dict[str, int]) -> str:
    """{'partition_size': 512, 'num_warps': 4} -> 'ps=512 nw=4': initials keep the table narrow."""
    return " ".join(
        f"{''.join(word[0] for word in name.split('_'))}={value}" for name, value in launch.items()
    )


# (header, cell of a row)
_COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("implementation", lambda row: row["implementation"]),
    ("context", lambda row: row["context"]),
    ("launch", lambda row: _launch_label(row["launch"])),
    ("ms", lambda row: f"{row['median_ms']:.3f}"),
    ("GB/s", lambda row: f"{row['gbps']:.0f}"),
    ("of copy", lambda row: f"{row['fraction_of_copy']:.0%}"),
    ("SDPA GB/s", lambda row: f"{row['sdpa_gbps']:.0f}"),
    ("vs SDPA", lambda row: f"{row['vs_sdpa']:.2f}x"),
    ("rel err", lambda row: f"{row['rel_err']:.1e}"),
    (
        "vs unwindowed",
        lambda row: f"{row['speedup_vs_unwindowed']:.2f}x" if "speedup_vs_unwindowed" in row else "",
    ),
)


def format_table(rows: list[dict[str, Any]]) -> str:
    """Rows as an aligned text table, one line per row under a header."""
    cells = [[header for header, _ in _COLUMNS]] + [[cell(row) for _, cell in _COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS))]
    return "\n".join(
        "  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip() for line in cells
    )


def write_plot(report: dict[str, Any], path: str) -> None:
    """Achieved GB/s per context: each implementation (and its best sweep launch), SDPA on the
    contiguous cache, and the copy ceiling as a line over each group."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}", file=sys.stderr)
        return
    default_rows = [row for row in report["rows"] if row["default_launch"]]
    contexts = list(dict.fromkeys(row["context"] for row in default_rows))
    series: dict[str, dict[str, float]] = {}
    for row in default_rows:
        series.setdefault(row["implementation"], {})[row["context"]] = row["gbps"]
    for row in report["best"]:
        series.setdefault(f"{row['implementation']} (best launch)", {})[row["context"]] = row["gbps"]
    series["SDPA, contiguous cache"] = {row["context"]: row["sdpa_gbps"] for row in default_rows}
    copy_gbps = {row["context"]: row["copy_gbps"] for row in default_rows}

    fig = Figure(figsize=(1.8 + 1.6 * len(contexts), 4.5))
    ax = fig.subplots()
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [x - 0.4 + (i + 0.5) * width for x, context in enumerate(contexts) if context in values]
        ax.bar(xs, [values[context] for context in contexts if context in values], width, label=name)
    ax.hlines(
        [copy_gbps[c] for c in contexts],
        [x - 0.45 for x in range(len(contexts))],
        [x + 0.45 for x in range(len(contexts))],
        colors="black",
        linestyles="dashed",
        label="copy (the ceiling)",
    )
    ax.set_xticks(range(len(contexts)), contexts)
    ax.set_xlabel("context length (LO-HI: ragged, uniform in [LO, HI])")
    ax.set_ylabel("achieved GB/s")
    config = report["config"]
    ax.set_title(
        f"decode attention on {report['device']}: batch {config['batch_size']}, "
        f"{config['num_heads']}/{config['num_kv_heads']} heads of {config['head_size']}, {config['dtype']}",
        fontsize=9,
    )
    # Below the axes: the copy lines run along the top of the plot.
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    fig.savefig(path, dpi=120, bbox_inches="tight")
