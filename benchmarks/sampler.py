"""The sampler's last pass on the GPU: the fused split reduction (kernels/triton/sampling.py)
against the torch path it replaces (``log_softmax`` of the whole row, ``argmax``, a gather; for
sampled rows the race's elementwise passes too), at W3's shape (one row of Llama-3's 128,256
tokens) and W1's (256 rows of Qwen3's 151,936).

    PYTHONPATH=. python benchmarks/sampler.py [--output-json F]
    PYTHONPATH=. python benchmarks/sampler.py --cpu

``--cpu``: the CPU's draw instead, a temperature-sampled batch of 32 rows of SmolLM2's 49,152
tokens through ``Sampler``, against the race with a vocabulary of exponential draws per row
that it replaced there (wall-clock median of 20 calls).

Two figures per side, CUDA events around 50 calls after 10 of warm-up, median of 5 repeats:
launched one by one (``eager``: the device's time or the host's launches, whichever is longer) and
replayed from a captured CUDA graph (``graph``: the device's time alone). Noise is drawn beforehand
so both sides read the same inputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, _exponential_noise, _race

SHAPES = {"W3 (1 x 128,256)": (1, 128_256), "W1 (256 x 151,936)": (256, 151_936)}


def _time_us(fn, repeats: int = 5, calls: int = 50) -> tuple[float, float]:
    """(eager, graph) microseconds per call."""
    for _ in range(10):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    figures = []
    for run in (lambda: [fn() for _ in range(calls)], graph.replay):
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(1e3 * start.elapsed_time(end) / calls)
        figures.append(statistics.median(times))
    return figures[0], figures[1]


def _torch_path(raw, noise, inv_temperature, greedy):
    tokens = _race(raw, noise, inv_temperature, greedy)
    return tokens, torch.log_softmax(raw, dim=-1).gather(-1, tokens[:, None])


def _cpu() -> None:
    rows, vocab = 32, 49_152
    logits = torch.randn((rows, vocab))
    temperature = torch.full((rows,), 0.8)
    metadata = SamplingMetadata(
        temperature=temperature, greedy=torch.zeros(rows, dtype=torch.bool), all_greedy=False
    )

    def race():
        noise = _exponential_noise(logits, metadata)
        return _race(logits, noise, 1.0 / temperature, metadata.greedy)

    for name, fn in (("race", race), ("inverse CDF (Sampler)", lambda: Sampler()(logits.clone(), metadata))):
        fn()
        times = []
        for _ in range(20):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        print(f"{name}: {1e3 * statistics.median(times):.2f} ms for {rows} rows x {vocab}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--cpu", action="store_true", help="the CPU's draw against the race")
    args = parser.parse_args()
    if args.cpu:
        return _cpu()
    from pagedllm.kernels.triton.sampling import sample_tokens

    result = {"device": torch.cuda.get_device_name()}
    for name, (rows, vocab) in SHAPES.items():
        raw = torch.randn((rows, vocab), device="cuda")
        noise = torch.empty_like(raw).exponential_()
        inv_temperature = torch.ones(rows, device="cuda")
        greedy = torch.zeros(rows, dtype=torch.bool, device="cuda")
        for mode, extra in (("greedy", (None, None, None)), ("sampled", (noise, inv_temperature, greedy))):
            fused = _time_us(lambda raw=raw, extra=extra: sample_tokens(raw, raw, *extra))
            reference = _time_us(lambda raw=raw, extra=extra: _torch_path(raw, *extra))
            figures = {}
            for i, how in enumerate(("eager", "graph")):
                speedup = reference[i] / fused[i]
                figures[how] = {"fused_us": fused[i], "torch_us": reference[i], "speedup": speedup}
                print(
                    f"{name} {mode} ({how}): fused {fused[i]:.1f} us, "
                    f"torch {reference[i]:.1f} us ({speedup:.2f}x)"
                )
            result[f"{name} {mode}"] = figures
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
