"""W1 through Hugging Face transformers and through pagedllm, in one process, on the same weights.

    PYTHONPATH=. python benchmarks/compare_hf.py [--num-prompts N] [--skip-hf-batch] [--output-json F]

1. Random bf16 weights for W1's architecture (Qwen3-0.6B) are drawn once with transformers'
   own initialisation and saved as safetensors, so both engines run exactly the same model.
2. HF static batching: ``generate`` over batches of 64 prompts, left-padded, greedy, 256 new
   tokens each (EOS ignored).
3. HF continuous batching: ``generate_batch`` (its paged cache), same requests.
4. pagedllm: every request queued at once (``pagedllm bench throughput``'s loop).
Prints output tokens per second for each and pagedllm's ratio to each HF mode.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.bench.throughput import OFFLINE_MAX_NUM_BATCHED_TOKENS, run
from pagedllm.entrypoints.bench.workloads import WORKLOADS

STATIC_BATCH_SIZE = 64


def save_dummy_model(config_dir: str, out_dir: str) -> None:
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)


def load_hf(model_dir: str, attn_implementation: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation=attn_implementation
    )
    return model.to("cuda").eval()


def hf_static(model_dir: str, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    model = load_hf(model_dir, "sdpa")
    config = GenerationConfig(
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )

    def generate(batch: list[list[int]]) -> int:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        return (out.shape[1] - width) * len(batch)

    generate(prompts[:2])  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    num_tokens = sum(
        generate(prompts[i : i + STATIC_BATCH_SIZE]) for i in range(0, len(prompts), STATIC_BATCH_SIZE)
    )
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    _free(model)
    return {"elapsed_s": elapsed, "output_tokens": num_tokens, "output_tok_s": num_tokens / elapsed}


def hf_generate_batch(model_dir: str, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    model = load_hf(model_dir, "paged|sdpa")
    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, pad_token_id=0, eos_token_id=None)
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=config)
    torch.cuda.synchronize()
    # Includes its own warm-up (graph capture): generate_batch has no separate one.
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.generated_tokens) for o in outputs.values())
    _free(model)
    return {"elapsed_s": elapsed, "output_tokens": num_tokens, "output_tok_s": num_tokens / elapsed}


def pagedllm_w1(
    model_dir: str, prompts: list[list[int]], output_len: int, **engine_kwargs
) -> dict[str, float]:
    workload = WORKLOADS["W1"]
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=model_dir,
            max_model_len=workload.max_model_len,
            enable_chunked_prefill=True,
            max_num_batched_tokens=OFFLINE_MAX_NUM_BATCHED_TOKENS,
            **engine_kwargs,
        )
    )
    run(engine, prompts[:64], 16)  # warm-up: the same shapes as the timed run (as bench throughput)
    result = run(engine, prompts, output_len)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return {k: result[k] for k in ("elapsed_s", "output_tokens", "output_tok_s", "median_decode_step_ms")}


def _free(model: torch.nn.Module) -> None:
    del model
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--skip-hf-batch", action="store_true", help="skip transformers' generate_batch")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    workload = WORKLOADS["W1"]
    prompts = workload.prompts(args.num_prompts)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as model_dir:
        save_dummy_model(workload.model, model_dir)
        results["hf_static"] = hf_static(model_dir, prompts, workload.output_len)
        if not args.skip_hf_batch:
            results["hf_generate_batch"] = hf_generate_batch(model_dir, prompts, workload.output_len)
        results["pagedllm"] = pagedllm_w1(
            model_dir, prompts, workload.output_len, attention_backend=args.attention_backend
        )
    device = torch.cuda.get_device_name()
    print(f"W1 ({len(prompts)} requests, {workload.output_len} output tokens each) on {device}:")
    for name, r in results.items():
        print(f"  {name:18s} {r['output_tok_s']:9.0f} output tok/s  ({r['elapsed_s']:.1f} s)")
    for name in ("hf_static", "hf_generate_batch"):
        if name in results:
            ratio = results["pagedllm"]["output_tok_s"] / results[name]["output_tok_s"]
            print(f"  pagedllm / {name}: {ratio:.1f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": device, "num_prompts": len(prompts), **results}, f, indent=1)


if __name__ == "__main__":
    main()
