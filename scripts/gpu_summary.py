"""Print one table of every figure gpu_check.sh produced (the JSON files in the given folder)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _load(folder: str, name: str) -> dict | list | None:
    path = os.path.join(folder, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def rows(folder: str) -> list[tuple[str, str, str]]:
    """(benchmark, figure, value) rows for whatever ran."""
    table: list[tuple[str, str, str]] = []
    for name in ("w1", "w1_cuda", "w1_lora", "w1_fp8kv", "w2", "w2_fp8", "w5", "w6", "w7"):
        r = _load(folder, name)
        if r:
            label = f"{r['workload']} {r['attention_backend']}" + _variant(name)
            table.append((label, "output tok/s", f"{r['output_tok_s']:.0f}"))
            table.append(
                (
                    label,
                    "elapsed / median decode step",
                    f"{r['elapsed_s']:.2f} s / {r['median_decode_step_ms']:.2f} ms",
                )
            )
            if "floor" in r:
                table.append((label, "fraction of floor (floor s)", _floor(r)))
            if "kv_bytes_per_token" in r:
                kv = r["kv_bytes_per_token"]
                table.append(
                    (label, "KV B/token (Llama-3.1-8B's)", f"{kv['model']:,} ({kv['llama-3.1-8b']:,})")
                )
    for name in ("w3", "w3_lora", "w3_fp8", "w3_w4a16", "w3_spec", "w3_eagle_1.0", "w3_eagle_0.7"):
        r = _load(folder, name)
        for mode in ("cuda_graphs", "eager") if r else ():
            if mode in r:
                m = r[mode]
                table.append(
                    (
                        f"W3 {mode}{_variant(name)}",
                        "ms/token (x floor)",
                        f"{m['tpot_ms']:.2f} ({m['over_floor']:.2f}x of {r['floor_ms']:.2f})",
                    )
                )
                if m.get("profile"):
                    profiled = m["profile"]
                    cell = f"{profiled['device_ms_per_step']:.2f} / {profiled['wall_ms_per_step']:.2f}"
                    table.append((f"W3 {mode}{_variant(name)}", "profiled device / wall ms per token", cell))
    table += _quantized_rows(folder)
    table += _long_context_rows(folder)
    table += _prefix_rows(folder)
    table += _tensor_parallel_rows(folder)
    table += _spec_rows(folder)
    table += _variant_rows(folder)
    table += _spec_tensor_parallel_rows(folder)
    table += _context_parallel_rows(folder)
    table += _determinism_rows(folder)
    table += _data_parallel_rows(folder)
    r = _load(folder, "hf")
    if r:
        for mode in ("hf_static", "hf_generate_batch", "pagedllm"):
            if mode in r:
                table.append((f"W1 {mode}", "output tok/s", f"{r[mode]['output_tok_s']:.0f}"))
        for mode in ("hf_static", "hf_generate_batch"):
            if mode in r:
                ratio = r["pagedllm"]["output_tok_s"] / r[mode]["output_tok_s"]
                table.append(("W1 ratio", f"pagedllm / {mode}", f"{ratio:.1f}x"))
    for name in ("k1", "k1_fp8"):
        r = _load(folder, name)
        for row in [row for row in r["rows"] if row["default_launch"]] + r["best"] if r else ():
            label = f"K1{_variant(name)} {row['implementation']} ctx {row['context']}"
            launch = "default launch" if row in r["rows"] and row["default_launch"] else "best launch"
            table.append((label, f"GB/s (of copy; vs SDPA), {launch}", _k1(row)))
    r = _load(folder, "k1_mla")
    for row in r["rows"] if r else ():
        table.append((f"K1-MLA ctx {row['context']}", "ours / FlashInfer us (FI / ours; GB/s)", _k1_mla(row)))
    r = _load(folder, "moe")
    if r:
        for row in r["rows"]:
            table.append(
                (f"MoE {row['num_tokens']} tokens", "fused / torch per-expert ms (ratio)", _moe(row))
            )
            if "best_ms" in row:
                table.append((f"MoE {row['num_tokens']} tokens", "best launch ms (ratio)", _moe_best(row)))
    r = _load(folder, "k1_window")
    if r:
        for row in [row for row in r["rows"] if "sliding_window" in row]:
            label = f"K1 {row['implementation']} ctx {row['context']}"
            speedup = row.get("speedup_vs_unwindowed")
            vs = f", {speedup:.2f}x faster than unwindowed" if speedup else ""
            table.append((label, "GB/s of window bytes (of copy; vs SDPA)", _k1(row) + vs))
    for file, model in (("so", "SmolLM2-135M"), ("so_8b", "8B shape")):
        r = _load(folder, file)
        for name, run in (r or {}).items():
            cell = f"{run['tokens_per_s']:.0f}" + (
                f" ({run['slowdown']:.1%} slower)" if "slowdown" in run else ""
            )
            table.append((f"SO {model} {name}", "output tok/s (target: at most 10% slower)", cell))
    r = _load(folder, "sampler")
    if r:
        for name, runs in r.items():
            for how, run in runs.items() if isinstance(runs, dict) else ():
                cell = f"{run['fused_us']:.1f} / {run['torch_us']:.1f} ({run['speedup']:.2f}x)"
                table.append((f"sampler {name}", f"fused / torch us, {how}", cell))
    for name, label in (
        ("w4", "W4"),
        ("w4_thread", "W4 engine thread"),
        ("w4_dp1", "W4 DP=1"),
        ("w4_dp2", "W4 DP=2"),
    ):
        r = _load(folder, name)
        for summary in r.get("results", []) if r else ():
            table.append(
                (f"{label} {summary['request_rate']} req/s", "p99 TTFT / p99 TPOT (ms), failed", _w4(summary))
            )
    return table


def _quantized_rows(folder: str) -> list[tuple[str, str, str]]:
    """W2 with FP8 weights over W2 in bf16 (target >= 1.4x), and bench quant's decode rows."""
    table = []
    w2, w2_fp8 = _load(folder, "w2"), _load(folder, "w2_fp8")
    if w2 and w2_fp8:
        ratio = w2_fp8["output_tok_s"] / w2["output_tok_s"]
        table.append(("W2 fp8 / bf16", "output tok/s (target >= 1.4x)", f"{ratio:.2f}x"))
    r = _load(folder, "quant")
    for row in r["rows"] if r else ():
        if row["num_tokens"] <= 8:
            label = f"quant {row['shape']} {row['num_tokens']} tok {row['path']}"
            cell = f"{row['ms'] * 1e3:.1f} ({row['weight_gb_s']:.0f} GB/s, {row['copy_fraction']:.0%})"
            table.append((label, "us (weight GB/s, of copy)", cell))
    return table


def _long_context_rows(folder: str) -> list[tuple[str, str, str]]:
    """W6 at 32,768 tokens: the hybrid's median decode step over its all-attention twin's."""
    hybrid, dense = _load(folder, "w6_long_qwen3-next-2b"), _load(folder, "w6_long_qwen3-next-2b-attention")
    if not (hybrid and dense):
        return []
    steps = f"{hybrid['median_decode_step_ms']:.2f} / {dense['median_decode_step_ms']:.2f} ms"
    ratio = hybrid["median_decode_step_ms"] / dense["median_decode_step_ms"]
    return [("W6 32k decode step / all-attention", "ms (target <= 0.5x)", f"{steps} = {ratio:.2f}x")]


def _prefix_rows(folder: str) -> list[tuple[str, str, str]]:
    """W6's requests after a shared 2,048-token prefix: the prefill time of the hybrid (prefix
    caching off) and of its all-attention twin with and without it."""
    runs = {
        "hybrid, caching off": _load(folder, "w6_prefix_hybrid"),
        "twin, caching on": _load(folder, "w6_prefix_twin_enable"),
        "twin, caching off": _load(folder, "w6_prefix_twin_no-enable"),
    }
    table = [
        (f"W6 shared prefix: {name}", "prefill s (elapsed s)", f"{r['prefill_s']:.2f} ({r['elapsed_s']:.2f})")
        for name, r in runs.items()
        if r
    ]
    on, off = runs["twin, caching on"], runs["twin, caching off"]
    if on and off:
        saved = 1 - on["prefill_s"] / off["prefill_s"]
        table.append(("W6 shared prefix: caching's saving", "of the twin's prefill", f"{saved:.0%}"))
    return table


def _tensor_parallel_rows(folder: str) -> list[tuple[str, str, str]]:
    """W2 output tok/s and W3 ms/token at TP=1 and TP=2, W2 at PP=2, and each over TP=1 (targets:
    W2 TP=2 >= 1.8x, W3 TP=2 <= 0.6x, W2 PP=2 >= 1.7x)."""
    table = []
    w2 = {size: _load(folder, f"w2_tp{size}") for size in (1, 2)}
    w3 = {size: _load(folder, f"w3_tp{size}") for size in (1, 2)}
    for size in (1, 2):
        if w2[size]:
            table.append((f"W2 TP={size}", "output tok/s", f"{w2[size]['output_tok_s']:.0f}"))
        if w3[size]:
            m = w3[size]["cuda_graphs"]
            table.append(
                (f"W3 TP={size}", "ms/token (x floor)", f"{m['tpot_ms']:.2f} ({m['over_floor']:.2f}x)")
            )
    if w2[1] and w2[2]:
        ratio = w2[2]["output_tok_s"] / w2[1]["output_tok_s"]
        table.append(("W2 TP=2 / TP=1", "output tok/s (target >= 1.8x)", f"{ratio:.2f}x"))
    if w3[1] and w3[2]:
        ratio = w3[2]["cuda_graphs"]["tpot_ms"] / w3[1]["cuda_graphs"]["tpot_ms"]
        table.append(("W3 TP=2 / TP=1", "ms/token (target <= 0.6x)", f"{ratio:.2f}x"))
    pp2 = _load(folder, "w2_pp2")
    if pp2:
        table.append(("W2 PP=2", "output tok/s", f"{pp2['output_tok_s']:.0f}"))
        if w2[1]:
            ratio = pp2["output_tok_s"] / w2[1]["output_tok_s"]
            table.append(("W2 PP=2 / TP=1", "output tok/s (target >= 1.7x)", f"{ratio:.2f}x"))
    nccl = _load(folder, "w3_tp2_nccl")
    if nccl:
        table.append(("W3 TP=2, NCCL only", "ms/token", f"{nccl['cuda_graphs']['tpot_ms']:.2f}"))
    all_reduce = _load(folder, "all_reduce")
    for row in all_reduce["rows"] if all_reduce else ():
        table.append(
            (
                f"all-reduce {row['bytes'] // 1024} KiB",
                "us: NCCL / one-shot",
                f"{row['nccl_us']:.1f} / {row['one_shot_us']:.1f} "
                f"({row['nccl_us'] / row['one_shot_us']:.2f}x)",
            )
        )
    return table


def _spec_rows(folder: str) -> list[tuple[str, str, str]]:
    """Speculation against no speculation in the same call: W3 with the EAGLE-3 head (targets <= 0.33x
    at synthetic acceptance 1.0, <= 0.55x at 0.7); the n-gram verify step of k + 1 = 4 tokens (every
    draft accepted, so a step emits 4) over W3's decode step (target <= 1.1x); W1's prompts at batch
    B with n-gram drafts at synthetic acceptance 0.5 (target >= 0.95x at 64); and real weights on
    the editing workload (target >= 1.6x, identical greedy text); a verify step's decode attention
    with query groups (and without) over a decode step's."""
    table = []
    w3 = _load(folder, "w3")
    plain = w3["cuda_graphs"]["tpot_ms"] if w3 else None
    for name in ("w3_eagle_1.0", "w3_eagle_0.7"):
        r = _load(folder, name)
        if r and plain:
            ratio = r["cuda_graphs"]["tpot_ms"] / plain
            table.append((f"W3 {name[3:]} / W3", "ms/token (synthetic)", f"{ratio:.3f}x"))
    r = _load(folder, "w3_spec")
    if r and plain and r.get("synthetic_acceptance_rate") == 1.0:
        step = 4 * r["cuda_graphs"]["tpot_ms"]
        table.append(("W3 ngram verify step / decode step", "ms (synthetic 1.0)", f"{step / plain:.2f}x"))
    for prefix, label in (("w1_spec_b", "ngram"), ("w1_spec_always_b", "ngram at every batch size")):
        for path in sorted(Path(folder).glob(f"{prefix}*.json")):
            batch = path.stem.removeprefix(prefix)
            spec, base = _load(folder, path.stem), _load(folder, f"w1_b{batch}")
            if spec and base:
                ratio = spec["output_tok_s"] / base["output_tok_s"]
                figure = f"output tok/s, synthetic {spec['synthetic_acceptance_rate']}"
                cell = f"{ratio:.2f}x ({spec['output_tok_s']:.0f})"
                table.append((f"W1 batch {batch} {label} / none", figure, cell))
    for path in sorted(Path(folder).glob("verify_attn*.json")):
        r = _load(folder, path.stem)
        heads = f"{r['config']['num_heads']}/{r['config']['num_kv_heads']} heads"
        for row in r["rows"]:
            label = f"verify attention k=3 ({heads}), batch {row['batch_size']}, ctx {row['context']}"
            ratios = f"{row['grouped'] / row['decode']:.2f}x ({row['expanded'] / row['decode']:.2f}x)"
            table.append((label, "grouped (expanded) / decode", ratios))
    for path in sorted(Path(folder).glob("spec_editing*.json")):
        r = _load(folder, path.stem)
        cell = f"{r['speedup']:.2f}x, identical {r['identical']}"
        lookup = r.get("lookup", "default")
        table.append((f"editing ngram / none ({r['dtype']}, {lookup})", "output tok/s, real weights", cell))
    return table


def _variant_rows(folder: str) -> list[tuple[str, str, str]]:
    """W3 under benchmarks/variants' timing variants (w3-variants), each beside the plain run of
    its tensor-parallel size from the same call."""
    table = []
    for path in sorted(Path(folder).glob("w3v_*_tp*.json")):
        variant, size = path.stem.removeprefix("w3v_").rsplit("_tp", 1)
        r, base = _load(folder, path.stem), _load(folder, f"w3v_base_tp{size}")
        if not r or variant == "base":
            continue
        tpot = r["cuda_graphs"]["tpot_ms"]
        cell = f"{tpot:.2f}"
        if base:
            plain = base["cuda_graphs"]["tpot_ms"]
            cell += f" ({tpot - plain:+.2f} against {plain:.2f})"
        table.append((f"W3 TP={size} {variant}", "ms/token (against the plain run)", cell))
    return table


def _spec_tensor_parallel_rows(folder: str) -> list[tuple[str, str, str]]:
    """W3 at TP=2 with n-gram drafts and with the EAGLE-3 head, k=3, synthetic acceptance 1.0: n-gram
    drafts cost nothing on the GPU, so EAGLE-3 over n-gram is the draft's own cost over the
    verify-only figure (target <= 1.1x); and EAGLE-3 over W3 at TP=2 without speculation."""
    table = []
    runs = {method: _load(folder, f"w3_tp2_{method}") for method in ("ngram", "eagle")}
    for method, r in runs.items():
        if r:
            tpot = r["cuda_graphs"]["tpot_ms"]
            table.append((f"W3 TP=2 {method} (synthetic 1.0)", "ms/token", f"{tpot:.2f}"))
    eagle, ngram, plain = runs["eagle"], runs["ngram"], _load(folder, "w3_tp2")
    if eagle and ngram:
        ratio = eagle["cuda_graphs"]["tpot_ms"] / ngram["cuda_graphs"]["tpot_ms"]
        figure = "ms/token, the draft's cost (target <= 1.1x)"
        table.append(("W3 TP=2 eagle / ngram", figure, f"{ratio:.2f}x"))
    if eagle and plain:
        ratio = eagle["cuda_graphs"]["tpot_ms"] / plain["cuda_graphs"]["tpot_ms"]
        table.append(("W3 TP=2 eagle / no speculation", "ms/token (synthetic 1.0)", f"{ratio:.2f}x"))
    return table


def _context_parallel_rows(folder: str) -> list[tuple[str, str, str]]:
    """A 65,536-token prompt (Llama-3.1-8B's shape) at CP=1, CP=2 and TP=2: the prefill (time to the
    first token; target CP=2 <= 0.6x CP=1) and the decode at that context (target: CP=2's ms/token
    at most TP=2's)."""
    runs = {name: _load(folder, f"long_{name}") for name in ("cp1", "cp2", "tp2")}
    table = []
    for name, r in runs.items():
        if r:
            m = r["cuda_graphs"]
            figure = f"{m['ttft_ms'] / 1e3:.2f} s / {m['tpot_ms']:.2f} ms"
            table.append((f"{r['input_len']:,} tokens {name.upper()}", "prefill / decode ms/token", figure))
    cp1, cp2, tp2 = runs["cp1"], runs["cp2"], runs["tp2"]
    if cp1 and cp2:
        ratio = cp2["cuda_graphs"]["ttft_ms"] / cp1["cuda_graphs"]["ttft_ms"]
        table.append(("long prompt CP=2 / CP=1", "prefill time (target <= 0.6x)", f"{ratio:.2f}x"))
    if cp2 and tp2:
        ratio = cp2["cuda_graphs"]["tpot_ms"] / tp2["cuda_graphs"]["tpot_ms"]
        table.append(("long prompt CP=2 / TP=2", "decode ms/token (target <= 1.0x)", f"{ratio:.2f}x"))
    return table


def _data_parallel_rows(folder: str) -> list[tuple[str, str, str]]:
    """W4's p99 TTFT with --data-parallel-size 2 over 1, rate by rate (target at 64 req/s: <= 0.6x)."""
    runs = {size: _load(folder, f"w4_dp{size}") for size in (1, 2)}
    if not (runs[1] and runs[2]):
        return []
    by_rate = {s["request_rate"]: s for s in runs[1]["results"]}
    table = []
    for summary in runs[2]["results"]:
        one = by_rate.get(summary["request_rate"])
        if one:
            ratio = summary["ttft_ms"]["p99"] / one["ttft_ms"]["p99"]
            label = f"W4 DP=2 / DP=1 {summary['request_rate']} req/s"
            table.append((label, "p99 TTFT (target <= 0.6x at 64 req/s)", f"{ratio:.2f}x"))
    return table


def _determinism_rows(folder: str) -> list[tuple[str, str, str]]:
    """W1 output tok/s and W3 ms/token in the default mode and with batch_invariant=True, and
    their ratios (the mode's targets: W1 >= 0.9x, W3 <= 1.05x)."""
    table = []
    w1 = {mode: _load(folder, f"determinism_w1_{mode}") for mode in ("default", "batch_invariant")}
    w3 = {mode: _load(folder, f"determinism_w3_{mode}") for mode in ("default", "batch_invariant")}
    for mode in ("default", "batch_invariant"):
        if w1[mode]:
            table.append((f"W1 {mode}", "output tok/s", f"{w1[mode]['output_tok_s']:.0f}"))
        if w3[mode]:
            table.append((f"W3 {mode}", "ms/token", f"{w3[mode]['cuda_graphs']['tpot_ms']:.2f}"))
    if w1["default"] and w1["batch_invariant"]:
        ratio = w1["batch_invariant"]["output_tok_s"] / w1["default"]["output_tok_s"]
        table.append(("W1 batch_invariant / default", "output tok/s (target >= 0.9x)", f"{ratio:.3f}x"))
    if w3["default"] and w3["batch_invariant"]:
        ratio = w3["batch_invariant"]["cuda_graphs"]["tpot_ms"] / w3["default"]["cuda_graphs"]["tpot_ms"]
        table.append(("W3 batch_invariant / default", "ms/token (target <= 1.05x)", f"{ratio:.3f}x"))
    return table


def _variant(name: str) -> str:
    """The label a stage's variant adds to its workload's (w1_lora -> " lora")."""
    _, _, variant = name.partition("_")
    return f" {variant}" if variant else ""


def _k1(row: dict) -> str:
    return f"{row['gbps']:.0f} ({row['fraction_of_copy']:.0%}; {row['vs_sdpa']:.2f}x)"


def _k1_mla(row: dict) -> str:
    if "ratio" not in row:
        return f"{1e3 * row['ours_ms']:.1f} / no FlashInfer ({row['ours_gbps']:.0f})"
    times = f"{1e3 * row['ours_ms']:.1f} / {1e3 * row['flashinfer_ms']:.1f}"
    return f"{times} ({row['ratio']:.3f}x; {row['ours_gbps']:.0f} vs {row['flashinfer_gbps']:.0f})"


def _floor(r: dict) -> str:
    return f"{r['fraction_of_floor']:.0%} ({r['floor']['floor_s']:.2f} s)"


def _moe(row: dict) -> str:
    return f"{row['fused_ms']:.3f} / {row['torch_ms']:.3f} ({row['speedup']:.1f}x)"


def _moe_best(row: dict) -> str:
    return f"{row['best_ms']:.3f} ({row['best_speedup']:.1f}x) {row['best_launch']}"


def _w4(s: dict) -> str:
    return f"{s['ttft_ms']['p99']:.0f} / {s['tpot_ms']['p99']:.1f}, {s['failed']}"


def main() -> None:
    table = rows(sys.argv[1])
    if not table:
        print("no benchmark results")
        return
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))


if __name__ == "__main__":
    main()
