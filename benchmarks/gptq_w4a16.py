"""A GPTQ W4A16 checkpoint of a dense model, made by llm-compressor (its ``oneshot`` with a
``GPTQModifier``), for ``perplexity.py --checkpoint``.

    python benchmarks/gptq_w4a16.py --dense DIR --out DIR [--group-size 32] [--asymmetric]

Run it where llm-compressor is installed: it pins its own transformers and compressed-tensors, so
a virtual environment of its own keeps the project's (``python -m venv --system-site-packages
/tmp/lc && /tmp/lc/bin/pip install llmcompressor``). The calibration text is this repository's
own documentation (README.md and docs/*.md), which shares no text with the perplexity text
(``benchmarks/data/pride_and_prejudice_ch1.txt``): the checkpoint must not have seen what it is scored on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def calibration_chunks(tokenizer, seq_len: int, num_samples: int) -> list[list[int]]:
    """Token windows of ``seq_len`` over the repository's documentation, at most ``num_samples``."""
    text = "\n\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    ids = tokenizer(text)["input_ids"]
    return [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)][:num_samples]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dense", required=True, help="the dense HF checkpoint to quantize")
    parser.add_argument("--out", required=True)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--asymmetric", action="store_true", help="zero points (W4A16_ASYM)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--dampening-frac", type=float, default=0.01)
    parser.add_argument(
        "--calibration-ids",
        help="a JSON list of token-id lists to calibrate on instead of the documentation (such as "
        "text the model generated itself, which matches its own distribution)",
    )
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.dense, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.dense)
    if args.calibration_ids:
        chunks = [ids[: args.seq_len] for ids in json.loads(Path(args.calibration_ids).read_text())]
        chunks = chunks[: args.num_samples]
    else:
        chunks = calibration_chunks(tokenizer, args.seq_len, args.num_samples)
    dataset = Dataset.from_dict({"input_ids": chunks, "attention_mask": [[1] * len(c) for c in chunks]})
    weights = {
        "num_bits": 4,
        "type": "int",
        "strategy": "group",
        "group_size": args.group_size,
        "symmetric": not args.asymmetric,
    }
    recipe = GPTQModifier(
        config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
        ignore=["lm_head"],
        dampening_frac=args.dampening_frac,
    )
    oneshot(
        model=model,
        dataset=dataset,
        recipe=recipe,
        max_seq_length=args.seq_len,
        num_calibration_samples=len(chunks),
    )
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    print(f"{len(chunks)} calibration windows of {args.seq_len} tokens; saved {args.out}")


if __name__ == "__main__":
    main()
