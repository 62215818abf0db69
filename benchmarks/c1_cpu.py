"""C1: the embedded model on the CPU, pagedllm against HF ``generate``, in one process.

    PYTHONPATH=. python benchmarks/c1_cpu.py [--dtype float32|bfloat16] [--output-json F]

The 32 prompts of C1 (``benchmarks/c1_prompts.json``), each one user message through the chat template, 64
new tokens each (EOS ignored, greedy), on the embedded SmolLM2-135M-Instruct dequantized from its
GGUF. HF runs the same weights (dequantized by transformers from the same file) as one static batch
of 32, left-padded. Both in the same dtype; prints output tokens per second and the ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import embedded_model_path
from pagedllm.model_loader.gguf_loader import load_gguf_config
from pagedllm.tokenizer import apply_chat_template

PROMPTS_FILE = Path(__file__).with_name("c1_prompts.json")  # BENCHMARKS.md's C1 prompts
MAX_TOKENS = 64


def hf_model(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = embedded_model_path()
    model = LlamaForCausalLM(load_gguf_config(path)).eval()
    model.load_state_dict(
        load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"], strict=False
    )
    model.tie_weights()
    return model.to(dtype)


def run_hf(model: torch.nn.Module, prompts: list[list[int]], pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - start
    return (out.shape[1] - width) * len(prompts) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    questions = json.loads(PROMPTS_FILE.read_text())
    llm = LLM(device="cpu", dtype=args.dtype, max_model_len=512)
    tokenizer = llm.get_tokenizer()
    prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:4], sampling_params=params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    ours = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
    del llm
    theirs = run_hf(hf_model(dtype), prompts, tokenizer.eos_token_id)
    result = {
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "pagedllm_tok_s": ours,
        "hf_generate_tok_s": theirs,
        "ratio": ours / theirs,
    }
    print(
        f"C1 ({args.dtype}, {result['threads']} threads): pagedllm {ours:.0f} output tok/s, "
        f"HF generate {theirs:.0f} output tok/s, ratio {ours / theirs:.2f}x"
    )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
