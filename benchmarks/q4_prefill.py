"""Prefill with GGUF Q4 weights kept against dequantized: prompt tok/s of ~1,000-token prompts.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/q4_prefill.py gguf   # or: none
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/q4_prefill.py gguf none --runs 12

The embedded SmolLM2-135M-Instruct Q4_1 GGUF on one thread; a 64-token warm-up, then 1,000-token
prompts of random token ids (a different one each time, so no prefix is cached), ``max_tokens=1``.
Given several quantizations, one engine each in the same process, taking turns prompt by prompt
(the order reversed every other run), so that a shared machine's load weighs on each alike. Prints,
per quantization, the TTFTs, their median, and the prompt tok/s of the fastest and of the median,
as one JSON line; for each quantization after the first, also the median over runs of its TTFT
over the first's in the same run (``gguf none``: the dequantized path's over Q4's, so at or above
1.0 Q4 keeps up) and in how many runs the first was the faster.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagedllm import LLM, SamplingParams

PROMPT_LEN = 1000


def main(quantizations: list[str], num_runs: int) -> None:
    llms = {
        q: LLM(threads=1, quantization=q, max_model_len=2048, swap_space=0.01, enable_prefix_caching=False)
        for q in quantizations
    }
    rng = random.Random(0)
    prompt = [rng.randint(100, 40000) for _ in range(PROMPT_LEN)]
    params = SamplingParams(temperature=0, max_tokens=1)
    for llm in llms.values():
        llm.generate(prompt_token_ids=[prompt[:64]], sampling_params=params, use_tqdm=False)
    ttfts: dict[str, list[float]] = {q: [] for q in llms}
    for run in range(num_runs):
        shifted = [(token_id + run) % 49152 for token_id in prompt]
        for q in quantizations if run % 2 == 0 else reversed(quantizations):
            start = time.perf_counter()
            llms[q].generate(prompt_token_ids=[shifted], sampling_params=params, use_tqdm=False)
            ttfts[q].append(time.perf_counter() - start)
    first = quantizations[0]
    for q, times in ttfts.items():
        result = {
            "quantization": q,
            "ttft_s": [round(t, 2) for t in times],
            "median_ttft_s": round(statistics.median(times), 3),
            "prompt_tok_s": round(PROMPT_LEN / min(times), 1),
            "median_prompt_tok_s": round(PROMPT_LEN / statistics.median(times), 1),
        }
        if q != first:
            # Run by run, this engine's TTFT over the first's: above 1.0 the first is the faster.
            ratios = [t / f for t, f in zip(times, ttfts[first], strict=True)]
            result[f"median_pair_ratio_to_{first}"] = round(statistics.median(ratios), 3)
            result[f"pairs_{first}_faster"] = sum(r > 1.0 for r in ratios)
        print(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("quantizations", nargs="*", default=["gguf"], choices=["gguf", "none"])
    parser.add_argument("--runs", type=int, default=3, help="prompts per quantization")
    args = parser.parse_args()
    main(args.quantizations, args.runs)
