"""Host time of the n-gram drafter (``NgramProposer``) over one step of W1-shaped requests.

    PYTHONPATH=. python benchmarks/ngram_drafting.py [--num-requests 64] [--steps 100]

Each request holds a prompt of 100-1,024 random tokens (W1's lengths, a 151,936-token vocabulary)
and 128 outputs; a step drafts 3 tokens for every request, appends one output to each and hands
the drafter the step's samples, as the scheduler does without asynchronous scheduling (where the
GPU waits for this host work). Prints the mean milliseconds per step.
"""

from __future__ import annotations

import argparse
import random
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.core.request import Request
from pagedllm.core.spec_decode import NgramProposer
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_config import SpeculativeConfig
from pagedllm.step_io import ModelRunnerOutput

VOCAB = 151_936


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    rng = random.Random(0)
    drafter = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    requests = []
    for req_id in range(args.num_requests):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(100, 1024))]
        request = Request(req_id, prompt, SamplingParams(max_tokens=128 + args.steps + 1), 16)
        for _ in range(128):
            request.append_output_token(rng.randrange(VOCAB), 0.0)
        requests.append(request)

    def step() -> None:
        for request in requests:
            drafter.draft(request, 3)
            request.append_output_token(rng.randrange(VOCAB), 0.0)
        drafter.receive(ModelRunnerOutput([], [], []))

    step()  # the first step builds each request's array
    per_step = timeit.timeit(step, number=args.steps) / args.steps
    print(f"n-gram drafting: {1e3 * per_step:.3f} ms per step of {args.num_requests} requests")


if __name__ == "__main__":
    main()
