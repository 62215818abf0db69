"""StreamingLLM's finding on the embedded model: a sliding window alone loses the text once its
first tokens leave the window; keeping a few of them (attention sinks) restores it.

    PYTHONPATH=. python benchmarks/streaming_perplexity.py [--windows 32,64,128] [--sinks 4]
        [--dtype float32] [--output-json F]

Scores a public-domain text (``data/pride_and_prejudice_ch1.txt``: Jane Austen, 1813) with the
embedded SmolLM2-135M-Instruct, from its prompt log-probabilities, three ways per window: full
attention, the window alone (``sliding_window``), and the window plus the first tokens
(``sliding_window`` and ``attention_sinks``, re-positioned as Xiao et al. 2023 do). Each token is
scored as StreamingLLM would have generated it: one prefill applies the same masks and positions
as a token-by-token run.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from c1_accuracy import TEXT, text_logprobs  # beside this script

from pagedllm import LLM


def perplexity(dtype: str, **window: int) -> tuple[float, int]:
    """(perplexity of TEXT, its token count) under the engine options ``window``."""
    llm = LLM(device="cpu", dtype=dtype, quantization="none", max_model_len=1024, **window)
    text_ids = llm.get_tokenizer()(TEXT.read_text())["input_ids"]
    logprobs = text_logprobs(llm, text_ids)
    return math.exp(-sum(logprobs) / len(logprobs)), len(text_ids)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--windows", default="32,64,128", help="comma-separated window sizes")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    full, num_tokens = perplexity(args.dtype)
    rows = []
    for window in (int(w) for w in args.windows.split(",")):
        alone, _ = perplexity(args.dtype, sliding_window=window)
        sinks, _ = perplexity(args.dtype, sliding_window=window, attention_sinks=args.sinks)
        rows.append({"window": window, "window_alone": alone, "window_and_sinks": sinks})
    print(f"{TEXT.name}: {num_tokens} tokens, full attention perplexity {full:.3f} ({args.dtype})")
    print(f"| window | window alone | window + {args.sinks} sinks |")
    print("| --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['window']} | {row['window_alone']:.3f} ({row['window_alone'] / full:.2f}x) | "
            f"{row['window_and_sinks']:.3f} ({row['window_and_sinks'] / full:.2f}x) |"
        )
    if args.output_json:
        result = {"tokens": num_tokens, "dtype": args.dtype, "sinks": args.sinks, "full": full, "rows": rows}
        Path(args.output_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
