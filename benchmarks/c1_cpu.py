"""C1: the embedded model on the CPU, pagedllm against its peers, in one sitting.

    PYTHONPATH=. python benchmarks/c1_cpu.py [--engines pagedllm-bf16,pagedllm-q4,hf-bf16,...]
        [--repeats 3] [--vllm-python VENV/bin/python] [--llamacpp-bf16-gguf F.gguf] [--output-json F]

The 32 prompts of C1 (``benchmarks/c1_prompts.json``), each one user message through pagedllm's
tokenizer and chat template, 64 new tokens each (EOS ignored, greedy); every engine gets the same
prompt token ids. Engines (each run in its own process, interleaved, ``--repeats`` times):

* ``pagedllm-{f32,bf16}``: the GGUF dequantized (``quantization="none"``); ``pagedllm-q4``: its
  Q4_1 weights kept at 4 bits (``quantization="gguf"``, bf16 activations); ``pagedllm-q4c``: the
  same with the one-stream decode step compiled (``cpu_compile=True``).
* ``hf-{f32,bf16}``: HF ``generate`` on the same dequantized weights, one left-padded batch of 32.
* ``llamacpp-q4``: llama.cpp through ``llama-cpp-python`` (when installed) on the shipped Q4_1
  file; ``llamacpp-bf16`` on ``--llamacpp-bf16-gguf``, the same weights in BF16
  (``llama-quantize --allow-requantize Q4_1.gguf out.gguf BF16``). All 32 sequences in one
  context, one token each per decode.
* ``vllm-{f32,bf16}``: vLLM's CPU build in its own virtualenv (``--vllm-python``), on an HF
  directory of the dequantized weights written here.

Each engine reports C1 output tokens per second, one stream's ms per token (one prompt, 64
tokens) and its process's peak RSS; the table gives medians (and the spread) over the repeats.
On a shared machine start it as ``setsid -w sh -c 'echo -20 > /proc/self/autogroup; exec CMD'``
(benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS_FILE = Path(__file__).with_name("c1_prompts.json")  # benchmarks/README.md's C1 prompts
MAX_TOKENS = 64
ENGINES = (
    "pagedllm-bf16",
    "pagedllm-q4",
    "pagedllm-q4c",
    "pagedllm-f32",
    "hf-bf16",
    "hf-f32",
    "llamacpp-q4",
    "llamacpp-bf16",
    "vllm-bf16",
)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- engines, each run in a child process: (C1 tok/s, one stream ms/token) --------------------


def run_pagedllm(
    prompts: list[list[int]], dtype: str, quantization: str, cpu_compile: bool = False
) -> tuple[float, float]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(
        device="cpu", dtype=dtype, quantization=quantization, max_model_len=512, cpu_compile=cpu_compile
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def generate(batch: list[list[int]]) -> float:
        start = time.perf_counter()
        llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
        return time.perf_counter() - start

    generate(prompts[:4])  # warm-up
    return len(prompts) * MAX_TOKENS / generate(prompts), generate(prompts[:1]) / MAX_TOKENS * 1e3


def hf_model(dtype: str):  # -> transformers LlamaForCausalLM
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from pagedllm.engine.arg_utils import embedded_model_path
    from pagedllm.model_loader.gguf_loader import load_gguf_config

    path = embedded_model_path()
    # A LlamaConfig, not the plain config the engine reads from its cache (HF's model code may
    # depend on the class's defaults and methods).
    fields = {k: v for k, v in load_gguf_config(path).to_dict().items() if k != "model_type"}
    model = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    model.load_state_dict(
        load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"], strict=False
    )
    model.tie_weights()
    return model.to(getattr(torch, dtype))


def run_hf(prompts: list[list[int]], dtype: str, pad_id: int) -> tuple[float, float]:
    import torch

    model = hf_model(dtype)

    def generate(batch: list[list[int]]) -> float:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=pad_id,
            )
        return time.perf_counter() - start

    generate(prompts[:4])
    return len(prompts) * MAX_TOKENS / generate(prompts), generate(prompts[:1]) / MAX_TOKENS * 1e3


def run_llamacpp(prompts: list[list[int]], gguf_path: str, threads: int) -> tuple[float, float]:
    """llama.cpp's batched decoding through llama-cpp-python's C API bindings (as in llama.cpp's
    examples/batched): one context holding every sequence, greedy argmax of each logits row."""
    import ctypes

    import llama_cpp
    import numpy as np

    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(gguf_path.encode(), llama_cpp.llama_model_default_params())
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))

    def generate(batch_prompts: list[list[int]]) -> float:
        num_seqs, prompt_tokens = len(batch_prompts), sum(len(p) for p in batch_prompts)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = prompt_tokens + num_seqs * MAX_TOKENS
        cparams.n_batch = cparams.n_ubatch = max(prompt_tokens, num_seqs)
        cparams.n_seq_max = num_seqs
        cparams.n_threads = cparams.n_threads_batch = threads
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        batch = llama_cpp.llama_batch_init(cparams.n_batch, 0, num_seqs)

        def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
            """entries: (token, position, sequence, wants logits) -> each logits row's argmax."""
            batch.n_tokens = len(entries)
            rows = []
            for k, (token, pos, seq, logits) in enumerate(entries):
                batch.token[k], batch.pos[k], batch.n_seq_id[k] = token, pos, 1
                batch.seq_id[k][0], batch.logits[k] = seq, logits
                rows += [k] if logits else []
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            row = ctypes.POINTER(ctypes.c_float * n_vocab)
            return [
                int(np.argmax(ctypes.cast(llama_cpp.llama_get_logits_ith(ctx, k), row).contents))
                for k in rows
            ]

        start = time.perf_counter()
        entries = [(t, i, s, i == len(p) - 1) for s, p in enumerate(batch_prompts) for i, t in enumerate(p)]
        tokens = decode(entries)
        for step in range(MAX_TOKENS - 1):
            tokens = decode([(t, len(batch_prompts[s]) + step, s, True) for s, t in enumerate(tokens)])
        elapsed = time.perf_counter() - start
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        return elapsed

    generate(prompts[:4])
    return len(prompts) * MAX_TOKENS / generate(prompts), generate(prompts[:1]) / MAX_TOKENS * 1e3


def run_vllm(prompts: list[list[int]], dtype: str, hf_dir: str) -> tuple[float, float]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=hf_dir, dtype=dtype, max_model_len=512, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def generate(batch: list[list[int]]) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return time.perf_counter() - start

    generate(prompts[:4])
    return len(prompts) * MAX_TOKENS / generate(prompts), generate(prompts[:1]) / MAX_TOKENS * 1e3


def child(args: argparse.Namespace) -> None:
    """Run one engine once; print its JSON result as the last line."""
    spec = json.loads(Path(args.child_spec).read_text())
    prompts, engine = spec["prompts"], args.child
    kind, _, variant = engine.partition("-")
    dtype = {"f32": "float32", "bf16": "bfloat16", "q4": "bfloat16", "q4c": "bfloat16", "": "bfloat16"}[
        variant
    ]
    if kind == "pagedllm":
        quantization = "gguf" if variant.startswith("q4") else "none"
        tok_s, ms = run_pagedllm(prompts, dtype, quantization, cpu_compile=variant == "q4c")
    elif kind == "hf":
        tok_s, ms = run_hf(prompts, dtype, spec["pad_id"])
    elif kind == "llamacpp":
        gguf = spec["llamacpp_bf16_gguf"] if variant == "bf16" else spec["embedded_gguf"]
        tok_s, ms = run_llamacpp(prompts, gguf, spec["threads"])
    else:
        tok_s, ms = run_vllm(prompts, dtype, spec["hf_dir"])
    print(json.dumps({"engine": engine, "tok_s": tok_s, "ms_per_token": ms, "peak_rss_mb": peak_rss_mb()}))


# --- the sitting: prompts once, engines interleaved, medians -----------------------------------


def write_hf_dir(directory: Path) -> str:
    """The dequantized weights and tokenizer as an HF directory (vLLM loads those), once."""
    if not (directory / "config.json").is_file():
        hf_model("float32").save_pretrained(directory)
        embedded_tokenizer().save_pretrained(directory)
    return str(directory)


def embedded_tokenizer():  # -> the embedded model's transformers tokenizer
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.tokenizer import get_tokenizer

    return get_tokenizer(EngineArgs(device="cpu").create_engine_config().model_config)


def available(engine: str, args: argparse.Namespace) -> str | None:
    """Why ``engine`` cannot run in this sitting, or None."""
    import importlib.util

    if engine.startswith("llamacpp") and importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed"
    if engine == "llamacpp-bf16" and not args.llamacpp_bf16_gguf:
        return "no --llamacpp-bf16-gguf given"
    if engine.startswith("vllm") and not args.vllm_python:
        return "no --vllm-python given"
    return None


def sitting(args: argparse.Namespace) -> dict:
    from pagedllm.engine.arg_utils import embedded_model_path
    from pagedllm.tokenizer import apply_chat_template

    path = embedded_model_path()
    tokenizer = embedded_tokenizer()
    questions = json.loads(PROMPTS_FILE.read_text())
    spec = {
        "prompts": [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in questions],
        "pad_id": tokenizer.eos_token_id,
        "embedded_gguf": path,
        "llamacpp_bf16_gguf": args.llamacpp_bf16_gguf,
        "threads": os.cpu_count(),
    }
    engines = [e for e in args.engines.split(",") if e]
    skipped = {e: why for e in engines if (why := available(e, args))}
    engines = [e for e in engines if e not in skipped]
    if any(e.startswith("vllm") for e in engines):
        spec["hf_dir"] = write_hf_dir(Path(tempfile.gettempdir()) / "pagedllm-c1-smollm2-hf")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for _ in range(args.repeats):
        for engine in engines:  # interleaved, so drifts in the machine's load hit every engine
            python = args.vllm_python if engine.startswith("vllm") else sys.executable
            env = dict(
                os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}"
            )
            cmd = [python, __file__, "--child", engine, "--child-spec", f.name]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                raise RuntimeError(f"{engine} failed:\n{out.stderr[-3000:]}")
            # The child's result is its last JSON line: an engine may log to stdout after it
            # (vLLM 0.32 logs its shutdown there).
            result = [line for line in out.stdout.splitlines() if line.startswith("{")][-1]
            runs[engine].append(json.loads(result))
    return {"repeats": args.repeats, "skipped": skipped, "runs": runs}


def table(result: dict) -> str:
    lines = [
        "| engine | C1 tok/s (median, min-max) | one stream ms/token | peak RSS MB |",
        "| --- | --- | --- | --- |",
    ]
    for engine, runs in result["runs"].items():
        tok_s = [r["tok_s"] for r in runs]
        ms = statistics.median(r["ms_per_token"] for r in runs)
        rss = statistics.median(r["peak_rss_mb"] for r in runs)
        spread = f"{min(tok_s):.0f}-{max(tok_s):.0f}"
        lines.append(f"| {engine} | {statistics.median(tok_s):.0f} ({spread}) | {ms:.1f} | {rss:.0f} |")
    lines += [f"| {engine} | skipped: {why} | | |" for engine, why in result["skipped"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engines", default="pagedllm-bf16,pagedllm-q4,hf-bf16,llamacpp-q4,llamacpp-bf16,vllm-bf16"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-python", default=None, help="python of a virtualenv with vllm-cpu")
    parser.add_argument("--llamacpp-bf16-gguf", default=None, help="the embedded weights as a BF16 GGUF")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--child", choices=(*ENGINES, "vllm-f32"), help=argparse.SUPPRESS)
    parser.add_argument("--child-spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    result = sitting(args)
    print(table(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
