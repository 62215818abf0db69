"""Prefill with GGUF Q4 weights kept against dequantized: prompt tok/s of ~1,000-token prompts.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/q4_prefill.py gguf   # or: none

The embedded SmolLM2-135M-Instruct Q4_1 GGUF on one thread; a 64-token warm-up, then three
1,000-token prompts of random token ids (a different one each time, so no prefix is cached),
``max_tokens=1``. Prints the three TTFTs and the prompt tok/s of the fastest, as one JSON line.
"""

from __future__ import annotations

import json
import random
import sys
import time

from pagedllm import LLM, SamplingParams

PROMPT_LEN = 1000
NUM_RUNS = 3


def main(quantization: str) -> None:
    llm = LLM(
        threads=1, quantization=quantization, max_model_len=2048, swap_space=0.01, enable_prefix_caching=False
    )
    rng = random.Random(0)
    prompt = [rng.randint(100, 40000) for _ in range(PROMPT_LEN)]
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompt_token_ids=[prompt[:64]], sampling_params=params, use_tqdm=False)
    ttfts = []
    for run in range(NUM_RUNS):
        start = time.perf_counter()
        shifted = [(token_id + run) % 49152 for token_id in prompt]
        llm.generate(prompt_token_ids=[shifted], sampling_params=params, use_tqdm=False)
        ttfts.append(time.perf_counter() - start)
    result = {
        "quantization": quantization,
        "ttft_s": [round(t, 2) for t in ttfts],
        "prompt_tok_s": round(PROMPT_LEN / min(ttfts), 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gguf")
