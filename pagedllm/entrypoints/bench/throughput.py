"""``pagedllm bench throughput``: offline throughput, W1, W2, W5, W6 and W7 (benchmarks/README.md).

Every request is queued at once and the engine steps until all finish (greedy, EOS ignored,
dummy weights of the workload's architecture). Reports output and total tokens per second, and
the step timeline: each step's wall time and the tokens it computed, so that the prefill phase,
the decode phase and the per-step overhead can be read apart. ``--profile-steps N`` also profiles N
steps early and N once every prompt is in, on every rank (``step_profile.py``), and prints where
host and device time go. For a mixture of
experts (W5, W7) and for a hybrid (W6) it also reports the run against its floor
(``moe_floor.py``, ``hybrid_floor.py``); for the former, the KV cache bytes per token beside
Llama-3.1-8B's. ``--num-loras K --lora-rank R`` runs the requests with K random rank-R LoRA
adapters, request i with adapter i mod K (``lora_adapters.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from typing import Any

import torch
from transformers import AutoConfig

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.bench import add_synthetic_acceptance_arg, with_synthetic_acceptance, write_json
from pagedllm.entrypoints.bench.ceilings import copy_bandwidth, matmul_peak_flops
from pagedllm.entrypoints.bench.hybrid_floor import HYBRID_MODEL_TYPES, HybridShape, hybrid_floor
from pagedllm.entrypoints.bench.lora_adapters import write_random_adapters
from pagedllm.entrypoints.bench.moe_floor import MoeShape, kv_bytes_per_token, moe_floor
from pagedllm.entrypoints.bench.step_profile import add_profile_args, print_profile, profile_steps_of
from pagedllm.entrypoints.bench.workloads import CONFIG_DIR, WORKLOADS, Workload
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams

# Tokens per step for offline batches, vLLM's offline default on H100/H200-class GPUs: half as many
# prefill steps as 8,192 on W1 (0.37 s of prefill against 0.43 s; 30,385 and 30,592 output tok/s
# against 29,770 and 30,381, one H200 call), W2 unchanged (3,943 tok/s either way).
OFFLINE_MAX_NUM_BATCHED_TOKENS = 16384
# The mixtures of experts whose floor moe_floor.py knows (W5's Qwen3-MoE, Mixtral, W7's DeepSeek).
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3")


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--workload", choices=["W1", "W2", "W5", "W6", "W7"], default="W1")
    parser.add_argument("--num-prompts", type=int, default=None, help="the workload's first N prompts")
    parser.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="every prompt this many tokens (the workload's token stream) instead of its lengths: a long "
        "context's decode step (W6 at 32,768 against its all-attention twin)",
    )
    parser.add_argument(
        "--output-len", type=int, default=None, help="output tokens per request instead of the workload's"
    )
    parser.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="tokens every prompt starts with (a shared system prompt) before its own: what prefix "
        "caching reuses (W6 against its all-attention twin, whose blocks can be reused)",
    )
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--output-png", default=None)
    add_profile_args(parser, "steps early and N once every prompt is in")
    parser.add_argument("--profile-dir", default=None, help="where to write the profiler's trace")
    parser.add_argument(
        "--num-loras", type=int, default=0, help="random LoRA adapters spread over the requests (0: none)"
    )
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of the random LoRA adapters")
    add_synthetic_acceptance_arg(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(
        load_format="dummy",
        model=None,
        max_num_batched_tokens=OFFLINE_MAX_NUM_BATCHED_TOKENS,
        enable_chunked_prefill=True,
    )
    return parser


def workload_for(args: argparse.Namespace) -> Workload:
    """The workload ``--workload`` names, with ``--input-len`` / ``--output-len`` applied."""
    workload = WORKLOADS[args.workload]
    if args.input_len is not None:
        if args.input_len < 1:
            raise ValueError(f"--input-len must be at least 1, got {args.input_len}")
        workload = dataclasses.replace(workload, input_len=(args.input_len, args.input_len))
    if args.output_len is not None:
        if args.output_len < 2:  # the decode phase needs a step after the first token
            raise ValueError(f"--output-len must be at least 2, got {args.output_len}")
        workload = dataclasses.replace(workload, output_len=args.output_len)
    if args.prefix_len < 0:
        raise ValueError(f"--prefix-len must be at least 0, got {args.prefix_len}")
    return dataclasses.replace(workload, prefix_len=args.prefix_len)


def engine_args_for(workload: Workload, args: argparse.Namespace) -> EngineArgs:
    engine_args = with_synthetic_acceptance(EngineArgs.from_cli_args(args), args.synthetic_acceptance_rate)
    engine_args = dataclasses.replace(
        engine_args,
        model=engine_args.model or workload.model,
        max_model_len=engine_args.max_model_len or workload.max_model_len,
    )
    if args.num_loras:
        # Every adapter in a slot of its own: the batch mixes all of them every step.
        engine_args = dataclasses.replace(
            engine_args,
            enable_lora=True,
            max_loras=max(engine_args.max_loras, args.num_loras),
            max_lora_rank=max(engine_args.max_lora_rank, args.lora_rank),
        )
    return engine_args


def run(
    engine: LLMEngine,
    prompts: list[list[int]],
    output_len: int,
    profile_steps: int = 0,
    lora_requests: list[LoRARequest] | None = None,
    profile_mode: str = "torch",
) -> dict[str, Any]:
    """Queue every prompt (prompt i with adapter i mod len(lora_requests)), step until done;
    returns timings and the step timeline."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        lora = lora_requests[i % len(lora_requests)] if lora_requests else None
        engine.add_request(
            str(i), sampling_params=params, prompt_token_ids=prompt, stream=False, lora_request=lora
        )
    prefill_at_start = engine.get_stats().num_prefill_tokens
    timeline: list[tuple[float, int, int]] = []  # (step seconds, prefill tokens, sampled tokens)
    num_prompt = sum(len(p) for p in prompts)
    profiles: dict[str, dict[str, Any]] = {}
    _synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        stats = engine.get_stats()
        if profile_steps:
            # Once early (prefill chunks beside the first decodes), once every prompt is in.
            phase = "prefill" if "prefill" not in profiles else "decode"
            prefilled = stats.num_prefill_tokens - prefill_at_start >= num_prompt
            if phase not in profiles and (phase == "prefill" or prefilled):
                profiles[phase] = profile_steps_of(engine, profile_steps, profile_mode)
                continue
        step_start = time.perf_counter()
        engine.step()
        after = engine.get_stats()
        timeline.append(
            (
                time.perf_counter() - step_start,
                after.num_prefill_tokens - stats.num_prefill_tokens,
                after.num_generation_tokens - stats.num_generation_tokens,
            )
        )
    _synchronize()
    elapsed = time.perf_counter() - start
    num_output = len(prompts) * output_len
    decode_steps = [t for t, prefill, _ in timeline if prefill == 0]
    return {
        "elapsed_s": elapsed,
        "num_requests": len(prompts),
        "output_tokens": num_output,
        "prompt_tokens": num_prompt,
        "output_tok_s": num_output / elapsed,
        "total_tok_s": (num_output + num_prompt) / elapsed,
        "num_steps": len(timeline),
        "prefill_s": sum(t for t, prefill, _ in timeline if prefill > 0),
        "decode_s": sum(decode_steps),
        "median_decode_step_ms": 1e3 * sorted(decode_steps)[len(decode_steps) // 2] if decode_steps else None,
        "timeline": timeline,
        "profiles": profiles,
    }


def _synchronize() -> None:
    # With several ranks the GPUs are the rank processes' (this one has no CUDA context, and
    # making one would take memory from rank 0); a step returns once rank 0's tokens are back.
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def attention_backend_name(worker: Any) -> str:
    """Run on a rank (``collective_rpc``): its attention backend."""
    return worker.attn_backend.name


def _floor(
    engine: LLMEngine, prompts: list[list[int]], output_len: int, cached_prefix_len: int
) -> dict[str, Any] | None:
    """The run's floor where one is derived for its model (a mixture of experts, a hybrid), the
    ``cached_prefix_len`` tokens every prompt starts with counted as computed once."""
    config = engine.config
    hf_config = config.model_config.hf_config
    if hf_config.model_type in MOE_MODEL_TYPES:
        floor, shape = moe_floor, MoeShape.from_config(hf_config)
    elif hf_config.model_type in HYBRID_MODEL_TYPES:
        floor, shape = hybrid_floor, HybridShape.from_config(hf_config)
    else:
        return None
    return floor(
        shape,
        [len(p) for p in prompts],
        output_len,
        config.scheduler_config.max_num_seqs,
        config.model_config.dtype.itemsize,
        copy_bandwidth(),
        matmul_peak_flops(),
        cached_prefix_len,
    )


def _cached_prefix_len(engine: LLMEngine, prefix_len: int) -> int:
    """The shared prefix's tokens a cache hit can skip: its whole blocks, with prefix caching on."""
    if not engine.engine_core.scheduler.kv_cache_manager.enable_prefix_caching:
        return 0
    block_size = engine.config.cache_config.block_size
    return prefix_len // block_size * block_size


def _kv_bytes_beside_llama(engine: LLMEngine) -> dict[str, int]:
    """KV cache bytes per token of the run's model and of Llama-3.1-8B, in the run's dtype."""
    element_size = engine.config.model_config.dtype.itemsize
    llama = AutoConfig.from_pretrained(os.path.join(CONFIG_DIR, "llama-3.1-8b"))
    return {
        "model": kv_bytes_per_token(engine.config.model_config.hf_config, element_size),
        "llama-3.1-8b": kv_bytes_per_token(llama, element_size),
    }


def plot(result: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    steps = result["timeline"]
    ends = []
    clock = 0.0
    for seconds, _, _ in steps:
        clock += seconds
        ends.append(clock)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(ends, [1e3 * s for s, _, _ in steps], lw=0.8)
    top.set_ylabel("step time (ms)")
    bottom.plot(ends, [sampled / s for s, _, sampled in steps], lw=0.8, label="sampled tok/s")
    bottom.plot(ends, [prefill / s for s, prefill, _ in steps], lw=0.8, label="prefill tok/s")
    bottom.set_ylabel("tokens / s")
    bottom.set_xlabel("seconds")
    bottom.legend()
    figure.suptitle(f"{result['workload']} on {result['device']}: {result['output_tok_s']:.0f} output tok/s")
    figure.savefig(path, dpi=120)
    return True


def main(args: argparse.Namespace) -> dict[str, Any]:
    if torch.cuda.device_count() == 0:  # NVML: the engine may fork its ranks after this
        raise SystemExit("pagedllm bench throughput needs a CUDA device")
    workload = workload_for(args)
    prompts = workload.prompts(args.num_prompts)
    engine_args = engine_args_for(workload, args)
    engine = LLMEngine.from_engine_args(engine_args)
    adapter_dir = tempfile.TemporaryDirectory(prefix="pagedllm-bench-lora-")
    loras = write_random_adapters(
        engine.config.model_config.hf_config, args.num_loras, args.lora_rank, adapter_dir.name
    )
    # Warm-up: a small run of the same shape (up to 64 of the prompts, chunked beside decodes of
    # every count up to 64) compiles the kernels' specialisations, touches the cache and fills the
    # adapters' slots before the timed run.
    run(engine, workload.prompts(min(64, len(prompts))), 16, lora_requests=loras)
    result = run(
        engine,
        prompts,
        workload.output_len,
        args.profile_steps,
        lora_requests=loras,
        profile_mode=args.profile_mode,
    )
    adapter_dir.cleanup()
    result.update(
        num_loras=args.num_loras,
        lora_rank=args.lora_rank if args.num_loras else None,
        workload=workload.name,
        device=torch.cuda.get_device_name(),
        attention_backend=engine.executor.collective_rpc(attention_backend_name)[0],
        tensor_parallel_size=engine.config.parallel_config.tensor_parallel_size,
        pipeline_parallel_size=engine.config.parallel_config.pipeline_parallel_size,
        enforce_eager=engine.config.enforce_eager,
        batch_invariant=engine.config.batch_invariant,
        max_num_seqs=engine.config.scheduler_config.max_num_seqs,
        speculative_config=engine_args.speculative_config,
        synthetic_acceptance_rate=args.synthetic_acceptance_rate,
        num_gpu_blocks=engine.num_gpu_blocks,
        prefix_len=workload.prefix_len,
        # As the cache manager runs it: a hybrid model turns it off (docs/hybrid_models.md).
        enable_prefix_caching=engine.engine_core.scheduler.kv_cache_manager.enable_prefix_caching,
    )
    spec = engine.get_stats().spec_decoding
    if spec is not None:  # since start: the warm-up's verifications too
        result["acceptance_rate"] = spec.acceptance_rate
        result["mean_acceptance_length"] = spec.mean_acceptance_length
        # Requests' verifications (a request's drafts in one step), beside num_steps.
        result["num_verifications"] = spec.num_drafts
    cached = _cached_prefix_len(engine, workload.prefix_len)
    floor = _floor(engine, prompts, workload.output_len, cached)
    if floor is not None:
        result["floor"] = {**floor, "cached_prefix_len": cached}
        result["fraction_of_floor"] = floor["floor_s"] / result["elapsed_s"]
        state = f", state {floor['state_s']:.2f} s" if "state_s" in floor else ""
        once = f", the {cached}-token prefix computed once" if cached else ""
        print(
            f"{workload.name} floor {floor['floor_s']:.2f} s (decode weights "
            f"{floor['decode_weight_s']:.2f} s, KV {floor['kv_s']:.2f} s{state}, prefill "
            f"{floor['prefill_s']:.2f} s{once}): the run is at "
            f"{result['fraction_of_floor']:.0%} of it"
        )
    if engine.config.model_config.hf_config.model_type in MOE_MODEL_TYPES:
        result["kv_bytes_per_token"] = _kv_bytes_beside_llama(engine)
        kv = result["kv_bytes_per_token"]
        print(f"KV cache per token: {kv['model']:,} B, Llama-3.1-8B's {kv['llama-3.1-8b']:,} B")
    for phase, profiled in result["profiles"].items():
        print_profile(profiled, f"{phase} steps")
    engine.shutdown()
    variant = f" with {args.num_loras} rank-{args.lora_rank} LoRAs" if args.num_loras else ""
    if args.synthetic_acceptance_rate is not None:
        variant += (
            f" with drafts [SYNTHETIC: accepted at rate {args.synthetic_acceptance_rate}, not the model's]"
        )
    pp = result["pipeline_parallel_size"]
    print(
        f"{workload.name}{variant} at TP={result['tensor_parallel_size']}{f' PP={pp}' if pp > 1 else ''}: "
        f"{result['num_requests']} requests in {result['elapsed_s']:.2f} s: "
        f"{result['output_tok_s']:.0f} output tok/s, {result['total_tok_s']:.0f} total tok/s "
        f"(prefill {result['prefill_s']:.2f} s, decode {result['decode_s']:.2f} s over "
        f"{result['num_steps']} steps, median decode step {result['median_decode_step_ms']:.2f} ms)"
    )
    write_json(args.output_json, result)
    if args.output_png:
        plot(result, args.output_png)
    return result
