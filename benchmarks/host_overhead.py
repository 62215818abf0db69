"""Host time of one decode step, with the model replaced by a stub that returns at once.

    PYTHONPATH=. python benchmarks/host_overhead.py [--num-seqs 256]
    PYTHONPATH=. python benchmarks/host_overhead.py --num-seqs 1 --async-scheduling \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}' \
        --synthetic-acceptance-rate 1.0

Everything a step does on the host (schedule, apply the diffs to the persistent batch and build the
flattened batch, sample, update the requests from the samples, process outputs) runs as in a real
step; the forward pass costs nothing. This is the time a
GPU would sit idle per step if host and device did not overlap. Runs on the CPU, tiny random model.
With ``--speculative-config`` the steps verify drafts (at a synthetic acceptance rate: the stub's
logits accept nothing); the output tokens per sequence and step are reported beside the time.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm import LLM, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine


class _NoForward(torch.nn.Module):
    """Returns preallocated hidden states and logits: the host side alone is measured."""

    def __init__(self, hidden_size: int, vocab_size: int, max_rows: int) -> None:
        super().__init__()
        self.hidden = torch.zeros(max_rows, hidden_size)
        self.logits = torch.randn(max_rows, vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits[: hidden_states.shape[0]]


def _timed(owner: object, name: str, totals: dict[str, float]) -> None:
    method: Callable = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = method(*args, **kwargs)
        totals[name] += time.perf_counter() - start
        return result

    setattr(owner, name, wrapper)


class _TimedCall:
    """A callable object (the draft verifier) whose calls are timed; its attributes pass through."""

    def __init__(self, inner: Callable, name: str, totals: dict[str, float]) -> None:
        self._inner, self._name, self._totals = inner, name, totals

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        result = self._inner(*args, **kwargs)
        self._totals[self._name] += time.perf_counter() - start
        return result

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def measure(engine: LLMEngine, num_seqs: int, num_steps: int) -> tuple[float, dict[str, float]]:
    runner = engine.executor.worker.model_runner
    config = engine.config.model_config
    runner.model = _NoForward(config.hidden_size, config.vocab_size, 8192)
    totals: dict[str, float] = collections.defaultdict(float)
    _timed(engine.scheduler, "schedule", totals)
    _timed(runner, "update_states", totals)
    _timed(runner, "prepare_inputs", totals)
    _timed(runner, "sampler", totals)
    _timed(engine.scheduler, "update_from_output", totals)
    _timed(engine.engine_core, "_apply", totals)
    _timed(engine.output_processor, "process_outputs", totals)
    if runner.verifier is not None:
        runner.verifier = _TimedCall(runner.verifier, "verifier", totals)
    if runner.drafter is not None:
        _timed(runner.drafter, "propose", totals)
    rng = random.Random(0)
    spec = engine.config.speculative_config
    tokens_per_step = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    params = SamplingParams(temperature=0.0, max_tokens=tokens_per_step * num_steps + 20, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [rng.randrange(3, config.vocab_size) for _ in range(rng.randint(20, 50))]
        engine.add_request(str(i), sampling_params=params, prompt_token_ids=prompt, stream=False)
    for _ in range(5):  # prompts, then steady decoding
        engine.step()
    totals.clear()
    step_times = []
    generated = engine.scheduler.num_generation_tokens
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    tokens_per_step = (engine.scheduler.num_generation_tokens - generated) / num_steps / num_seqs
    # The median step: a shared machine's stalls land in a few steps, not in the host's work.
    phases = {name: total / num_steps for name, total in totals.items()}
    return statistics.median(step_times), phases, tokens_per_step


def tiny_llama_config() -> LlamaConfig:
    """A two-layer random Llama: its forward pass costs little beside the host's work."""
    return LlamaConfig(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--num-steps", type=int, default=100)
    parser.add_argument("--speculative-config", type=json.loads, default=None)
    parser.add_argument("--synthetic-acceptance-rate", type=float, default=None)
    parser.add_argument("--async-scheduling", action="store_true")
    args = parser.parse_args()
    spec = args.speculative_config
    if spec is not None and args.synthetic_acceptance_rate is not None:
        spec = {**spec, "synthetic_acceptance_rate": args.synthetic_acceptance_rate}
    with tempfile.TemporaryDirectory() as model_dir:
        AutoModelForCausalLM.from_config(tiny_llama_config()).save_pretrained(model_dir)
        llm = LLM(
            model_dir,
            device="cpu",
            max_model_len=512,
            max_num_seqs=args.num_seqs,
            speculative_config=spec,
            async_scheduling=args.async_scheduling,
        )
        per_step, phases, tokens_per_step = measure(llm.llm_engine, args.num_seqs, args.num_steps)
    kind = "verify" if spec is not None else "decode"
    print(f"host time per {kind} step of {args.num_seqs} sequences (median): {1e3 * per_step:.2f} ms")
    print(f"  output tokens per sequence and step: {tokens_per_step:.2f}")
    print("  mean per step by phase:")
    for name, seconds in sorted(phases.items(), key=lambda item: -item[1]):
        print(f"  {name:16s} {1e3 * seconds:.2f} ms")


if __name__ == "__main__":
    main()
