"""The functions a decode step passes through, from the engine's step to the kernels and back.

    PYTHONPATH=. python benchmarks/decode_path.py [--num-seqs 4] [--list]

A tiny random Llama runs on the CPU (float32, synchronous scheduling, so that the
step's whole path runs in this thread): requests are added, their prompts computed, and once every
request decodes one more step is traced with ``sys.setprofile``. The figure is the number of
distinct pagedllm functions (code objects: a method, a nested function, a comprehension counted
once each) entered during that step, and the number of calls into them. It measures how many
places a reader must visit to follow one decode step, not its speed (benchmarks/host_overhead.py
times the host's work).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path
from types import FrameType

from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from host_overhead import tiny_llama_config  # noqa: E402 (this folder is on the path as the script's)

from pagedllm import LLM, SamplingParams  # noqa: E402

PACKAGE = str(ROOT / "pagedllm")


def trace_step(step: collections.abc.Callable[[], object]) -> collections.Counter[str]:
    """Calls of each pagedllm function (``module:qualname``) entered while ``step()`` runs."""
    calls: collections.Counter[str] = collections.Counter()

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(PACKAGE):
            module = Path(code.co_filename).relative_to(ROOT).with_suffix("").as_posix()
            calls[f"{module}:{code.co_qualname}"] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=4)
    parser.add_argument("--attention-backend", default="auto", help="auto: the CPU path's default (cpu)")
    parser.add_argument("--list", action="store_true", help="print every function with its call count")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as model_dir:
        AutoModelForCausalLM.from_config(tiny_llama_config()).save_pretrained(model_dir)
        backend = args.attention_backend
        llm = LLM(model_dir, device="cpu", dtype="float32", attention_backend=backend, max_model_len=512)
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        for i in range(args.num_seqs):
            engine.add_request(str(i), sampling_params=params, prompt_token_ids=list(range(3, 23 + i)))
        for _ in range(3):  # the prompts, then decoding
            engine.step()
        trace_step(engine.step)  # warm: first-call imports and caches stay out of the count
        calls = trace_step(engine.step)
    print(f"decode step of {args.num_seqs} sequences: {len(calls)} distinct pagedllm functions, "
          f"{sum(calls.values())} calls")  # fmt: skip
    if args.list:
        for name, count in sorted(calls.items()):
            print(f"  {count:5d}  {name}")


if __name__ == "__main__":
    main()
