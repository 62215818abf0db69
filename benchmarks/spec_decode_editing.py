"""N-gram speculative decoding on an editing workload, with real weights (CPU or GPU).

32 chat prompts (``benchmarks/data/spec_decode_editing.jsonl``) ask the model to repeat or
lightly edit a given text or piece of code, so that much of each answer already occurs in its
prompt: the case prompt lookup is for. The embedded model (SmolLM2-135M-Instruct, GGUF Q4_1,
the one ``make run`` uses) answers each greedily, without speculation and with the n-gram
drafter; the script reports output tokens per second of each, the acceptance, and whether the
two runs' texts are identical (they must be: greedy speculation is lossless).

    PYTHONPATH=. python benchmarks/spec_decode_editing.py [--max-num-seqs 1] [--max-tokens 256] [--threads N]
    PYTHONPATH=. python benchmarks/spec_decode_editing.py --device cuda --dtype float32

On a GPU the GGUF's weights are dequantized to ``--dtype`` at load. Identity is asserted in any
dtype; in bfloat16 a verification's four rows and a decode's one may round a near-tie differently
(different GEMM shapes), so float32 is the dtype that separates the mechanism from the rounding.

By default requests run one at a time (``--max-num-seqs 1``): one stream, where a step reads
every weight for one token and verifying four tokens costs about as much as decoding one.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pagedllm import LLM, SamplingParams

DATA = Path(__file__).parent / "data" / "spec_decode_editing.jsonl"
ASYNC = {"default": None, "host": False, "device": True}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def load_prompts(num_prompts: int) -> list[list[dict[str, str]]]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return [[{"role": "user", "content": row["prompt"]}] for row in rows[:num_prompts]]


def run(
    conversations: list[list[dict[str, str]]], args: argparse.Namespace, speculative_config: dict | None
) -> dict[str, Any]:
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        threads=args.threads,
        speculative_config=speculative_config,
        # The speculative run's lookup: on the host (synchronous, the default) or on the device.
        async_scheduling=None if speculative_config is None else ASYNC[args.lookup],
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.chat(conversations[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result: dict[str, Any] = {
        "speculative_config": speculative_config,
        "seconds": elapsed,
        "output_tokens": num_tokens,
        "output_tok_per_s": num_tokens / elapsed,
        "texts": [o.outputs[0].text for o in outputs],
    }
    stats = llm.llm_engine.get_stats().spec_decoding
    if stats is not None:
        result["acceptance_rate"] = stats.acceptance_rate
        result["mean_acceptance_length"] = stats.mean_acceptance_length
        result["num_accepted_tokens_per_pos"] = stats.num_accepted_tokens_per_pos
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="a GGUF file or HF directory (default: the embedded model)"
    )
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: the physical cores)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the GGUF dequantized to --dtype)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--lookup",
        choices=list(ASYNC),
        default="default",
        help="where the n-gram drafts are looked up: the host (synchronous scheduling, ngram's "
        "default) or the device (asynchronous scheduling, worker/ngram_drafter.py)",
    )
    parser.add_argument("--speculative-config", default=json.dumps(NGRAM))
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    conversations = load_prompts(args.num_prompts)
    baseline = run(conversations, args, None)
    spec = run(conversations, args, json.loads(args.speculative_config))
    identical = baseline["texts"] == spec["texts"]
    differing = [i for i, (a, b) in enumerate(zip(baseline["texts"], spec["texts"], strict=True)) if a != b]
    speedup = spec["output_tok_per_s"] / baseline["output_tok_per_s"]
    print(
        f"without speculation: {baseline['output_tok_per_s']:.1f} output tok/s "
        f"({baseline['output_tokens']} tokens in {baseline['seconds']:.1f} s)"
    )
    print(
        f"ngram {spec['speculative_config']}: {spec['output_tok_per_s']:.1f} output tok/s "
        f"({spec['output_tokens']} tokens in {spec['seconds']:.1f} s), acceptance "
        f"{spec['acceptance_rate']:.2f}, {spec['mean_acceptance_length']:.2f} tokens per verification"
    )
    print(f"speedup {speedup:.2f}x; greedy texts identical: {identical} (prompts that differ: {differing})")
    if args.output_json:
        summary = {
            "device": args.device,
            "dtype": args.dtype,
            "lookup": args.lookup,
            "speedup": speedup,
            "identical": identical,
            "differing_prompts": differing,
            "baseline": baseline,
            "ngram": spec,
        }
        Path(args.output_json).write_text(json.dumps(summary, indent=1))
    if not identical:
        raise SystemExit("greedy texts differ between the runs")


if __name__ == "__main__":
    main()
