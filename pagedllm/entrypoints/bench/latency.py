"""``pagedllm bench latency``: one request's per-token latency, benchmarks/README.md's W3.

A single request (128 prompt tokens, 256 output tokens, greedy, EOS ignored) on dummy weights,
with CUDA graphs and, for comparison, eagerly. The floor is reading the weights a token reads
(``weight_read.py``: at the formats the layers keep, FP8 or 4-bit ones included; the embedding's
one row, the LM head whole) at the device's measured copy bandwidth (bytes read + written over
time, as benchmarks/README.md measures it): the per-token latency over that floor is the gap.
``--lora-rank R`` runs the request with one random rank-R LoRA adapter (``lora_adapters.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import tempfile
import time
from typing import Any

import torch

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.bench import add_synthetic_acceptance_arg, with_synthetic_acceptance, write_json
from pagedllm.entrypoints.bench.ceilings import copy_bandwidth
from pagedllm.entrypoints.bench.lora_adapters import write_random_adapters
from pagedllm.entrypoints.bench.step_profile import add_profile_args, print_profile, profile_steps_of
from pagedllm.entrypoints.bench.weight_read import worker_decode_weight_bytes
from pagedllm.entrypoints.bench.workloads import WORKLOADS
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--num-iters", type=int, default=3, help="timed runs per mode (median reported)")
    parser.add_argument("--skip-eager", action="store_true", help="measure with CUDA graphs only")
    add_profile_args(parser, "decode steps per mode")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--output-png", default=None)
    add_synthetic_acceptance_arg(parser)
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="run the request with one random LoRA adapter of this rank"
    )
    parser.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="prompt tokens instead of W3's 128 (W3's prompt repeated): a long context's prefill (the "
        "first token's time) and its decode",
    )
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(load_format="dummy", model=None, max_num_seqs=1)
    return parser


def time_request(
    engine: LLMEngine, prompt: list[int], output_len: int, lora_request: LoRARequest | None = None
) -> tuple[float, float]:
    """(seconds to the first token, seconds per later token) of one request alone."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.add_request("w3", sampling_params=params, prompt_token_ids=prompt, lora_request=lora_request)
    start = time.perf_counter()
    first = None
    while engine.has_unfinished_requests():
        # The first output is the first token (a step that only launched returns none).
        if engine.step() and first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return first - start, (end - first) / (output_len - 1)


def measure(
    engine_args: EngineArgs,
    prompt: list[int],
    output_len: int,
    num_iters: int,
    profile_steps: int = 0,
    lora_rank: int = 0,
    profile_mode: str = "torch",
) -> dict[str, Any]:
    if lora_rank:
        engine_args = dataclasses.replace(
            engine_args, enable_lora=True, max_lora_rank=max(engine_args.max_lora_rank, lora_rank)
        )
    engine = LLMEngine.from_engine_args(engine_args)
    adapter_dir = tempfile.TemporaryDirectory(prefix="pagedllm-bench-lora-")
    hf_config = engine.config.model_config.hf_config
    lora = write_random_adapters(hf_config, 1, lora_rank, adapter_dir.name)[0] if lora_rank else None
    time_request(engine, prompt, 8, lora)  # warm-up (and the adapter into its slot)
    runs = sorted(time_request(engine, prompt, output_len, lora) for _ in range(num_iters))
    adapter_dir.cleanup()
    profiled = None
    if profile_steps:
        params = SamplingParams(temperature=0.0, max_tokens=profile_steps + 2, ignore_eos=True)
        engine.add_request("profiled", sampling_params=params, prompt_token_ids=prompt)
        engine.step()  # the prompt: profile decode steps only
        profiled = profile_steps_of(engine, profile_steps, profile_mode)
        while engine.has_unfinished_requests():
            engine.step()
    # Every rank reads its own shard at once: the floor is the largest shard's read.
    weight_bytes = max(engine.executor.collective_rpc(worker_decode_weight_bytes))
    engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    ttft, tpot = runs[len(runs) // 2]
    return {"ttft_ms": 1e3 * ttft, "tpot_ms": 1e3 * tpot, "weight_bytes": weight_bytes, "profile": profiled}


def main(args: argparse.Namespace) -> dict[str, Any]:
    if torch.cuda.device_count() == 0:  # NVML: the engine may fork its ranks after this
        raise SystemExit("pagedllm bench latency needs a CUDA device")
    workload = WORKLOADS["W3"]
    prompt = workload.prompts()[0]
    if args.input_len is not None:
        prompt = (prompt * -(-args.input_len // len(prompt)))[: args.input_len]
    rate = args.synthetic_acceptance_rate
    engine_args = with_synthetic_acceptance(EngineArgs.from_cli_args(args), rate)
    synthetic = "" if rate is None else f" [SYNTHETIC: drafts accepted at rate {rate}, not the model's]"
    engine_args = dataclasses.replace(
        engine_args,
        model=engine_args.model or workload.model,
        max_model_len=engine_args.max_model_len
        or max(workload.max_model_len, len(prompt) + workload.output_len),
    )
    bandwidth = copy_bandwidth()
    torch.cuda.empty_cache()  # the copy's 2 GiB, cached here, would be counted against rank 0
    result: dict[str, Any] = {
        "workload": "W3",
        "device": torch.cuda.get_device_name(),
        "copy_gbps": bandwidth / 1e9,
        "tensor_parallel_size": engine_args.tensor_parallel_size,
        "context_parallel_size": engine_args.context_parallel_size,
        "input_len": len(prompt),
        "speculative_config": engine_args.speculative_config,
        "synthetic_acceptance_rate": rate,
        "batch_invariant": engine_args.batch_invariant,
    }
    modes = [("cuda_graphs", False)] + ([] if args.skip_eager else [("eager", True)])
    for mode, enforce_eager in modes:
        mode_args = dataclasses.replace(engine_args, enforce_eager=enforce_eager)
        result[mode] = measure(
            mode_args,
            prompt,
            workload.output_len,
            args.num_iters,
            args.profile_steps,
            args.lora_rank,
            args.profile_mode,
        )
        profiled = result[mode]["profile"]
        if profiled:
            print_profile(profiled, f"W3 {mode}{synthetic}")
    floor_ms = 1e3 * result["cuda_graphs"]["weight_bytes"] / bandwidth
    result["floor_ms"] = floor_ms
    for mode, _ in modes:
        m = result[mode]
        m["over_floor"] = m["tpot_ms"] / floor_ms
        lora_note = f" with a rank-{args.lora_rank} LoRA" if args.lora_rank else ""
        sizes = f"TP={engine_args.tensor_parallel_size}"
        if engine_args.context_parallel_size > 1:
            sizes += f" CP={engine_args.context_parallel_size}"
        if args.input_len is not None:
            sizes += f", {len(prompt):,}-token prompt"
        print(
            f"W3{lora_note} {mode} at {sizes}: {m['tpot_ms']:.2f} ms/token "
            f"({m['over_floor']:.2f}x the {floor_ms:.2f} ms "
            f"weight-read floor), first token {m['ttft_ms']:.1f} ms{synthetic}"
        )
    write_json(args.output_json, result)
    if args.output_png:
        _plot(result, [mode for mode, _ in modes], args.output_png)
    return result


def _plot(result: dict[str, Any], modes: list[str], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.bar(modes, [result[m]["tpot_ms"] for m in modes])
    axis.axhline(result["floor_ms"], color="k", ls="--", label="weight-read floor")
    axis.set_ylabel("ms per output token")
    axis.legend()
    label = "" if result["synthetic_acceptance_rate"] is None else " (synthetic acceptance)"
    axis.set_title(f"W3 on {result['device']}{label}")
    figure.savefig(path, dpi=120)
