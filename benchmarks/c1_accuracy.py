"""What bf16 and the Q4 path cost in accuracy on the embedded model, against float32 dense.

    PYTHONPATH=. python benchmarks/c1_accuracy.py [--output-json F]

Runs the embedded SmolLM2 three ways (float32 dequantized: the oracle; bf16 dequantized; bf16 with
its Q4_1 linear weights kept at 4 bits) and reports, for each against float32:

The Q4 path is also compared with bf16 dense, its own oracle (same dtype, weights dequantized).

* greedy agreement on C1 (32 chat prompts, 64 tokens, EOS ignored), as one batch and each prompt
  alone: prompts whose 64 tokens are all equal, and the mean length of the common prefix;
* perplexity on a public-domain text (``data/pride_and_prejudice_ch1.txt``: Jane Austen, 1813),
  from the prompt log-probabilities, and the largest difference of one token's log-probability.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.tokenizer import apply_chat_template

HERE = Path(__file__).parent
TEXT = HERE / "data" / "pride_and_prejudice_ch1.txt"
RUNS = {"float32": ("float32", "none"), "bf16": ("bfloat16", "none"), "bf16-q4": ("bfloat16", "gguf")}


def text_logprobs(llm: LLM, text_ids: list[int]) -> list[float]:
    """The log-probability of each token of the text after the first, given those before it: the
    prompt log-probabilities of one request (its prefill scores every position)."""
    scored = llm.generate(
        prompt_token_ids=[text_ids],
        sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )[0]
    return [entry[token].logprob for token, entry in zip(text_ids[1:], scored.prompt_logprobs[1:])]


def measure(dtype: str, quantization: str) -> dict:
    llm = LLM(device="cpu", dtype=dtype, quantization=quantization, max_model_len=1024)
    tokenizer = llm.get_tokenizer()
    questions = json.loads((HERE / "c1_prompts.json").read_text())
    prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
    # Each prompt alone too: one stream's steps take other kernels (the Q4 path's few-rows int4
    # products and 4-bit LM head) than a batch's.
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=greedy, use_tqdm=False)[0] for p in prompts]
    logprobs = text_logprobs(llm, tokenizer(TEXT.read_text())["input_ids"])
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "one_stream_tokens": [list(o.outputs[0].token_ids) for o in alone],
        "logprobs": logprobs,
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(run: dict, oracle: dict) -> dict:
    prefixes = [common_prefix(a, b) for a, b in zip(run["tokens"], oracle["tokens"])]
    alone = [common_prefix(a, b) for a, b in zip(run["one_stream_tokens"], oracle["one_stream_tokens"])]
    perplexity = math.exp(-sum(run["logprobs"]) / len(run["logprobs"]))
    oracle_ppl = math.exp(-sum(oracle["logprobs"]) / len(oracle["logprobs"]))
    return {
        "identical_prompts": sum(p == len(t) for p, t in zip(prefixes, run["tokens"])),
        "mean_common_prefix": sum(prefixes) / len(prefixes),
        "one_stream_identical_prompts": sum(p == len(t) for p, t in zip(alone, run["one_stream_tokens"])),
        "one_stream_mean_common_prefix": sum(alone) / len(alone),
        "perplexity": perplexity,
        "perplexity_change": perplexity / oracle_ppl - 1,
        "max_logprob_error": max(abs(x - y) for x, y in zip(run["logprobs"], oracle["logprobs"])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    runs = {name: measure(*how) for name, how in RUNS.items()}
    result = {f"{name} vs float32": compare(run, runs["float32"]) for name, run in runs.items()}
    # The Q4 path against its own oracle, the same file dequantized in the same dtype.
    result["bf16-q4 vs bf16"] = compare(runs["bf16-q4"], runs["bf16"])
    print(
        "| run | C1 prompts identical (of 32) | mean common prefix (of 64) | one stream: identical |", end=""
    )
    print(" one stream: common prefix | perplexity | change | max logprob error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in result.items():
        print(
            f"| {name} | {r['identical_prompts']} | {r['mean_common_prefix']:.1f} | "
            f"{r['one_stream_identical_prompts']} | {r['one_stream_mean_common_prefix']:.1f} | "
            f"{r['perplexity']:.3f} | {r['perplexity_change']:+.2%} | {r['max_logprob_error']:.3f} |"
        )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
