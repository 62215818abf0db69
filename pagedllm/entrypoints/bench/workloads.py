"""The offline workloads of benchmarks/README.md, drawn exactly as it specifies."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

# benchmarks/configs/ in the source tree: the architectures' config.json files.
CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "configs")


@dataclass(frozen=True)
class Workload:
    name: str
    model: str  # a directory with config.json (weights are dummy)
    num_prompts: int
    input_len: tuple[int, int]  # uniform [lo, hi]
    output_len: int
    # Tokens every prompt starts with (a shared system prompt) before its own: what prefix caching
    # can reuse.
    prefix_len: int = 0

    def prompts(self, num_prompts: int | None = None) -> list[list[int]]:
        """``random.seed(0); [[randint(0, 10000) for _ in range(randint(LO, HI))] for _ in range(N)]``,
        cut to the first ``num_prompts``, each after the shared prefix (``prefix_len`` tokens of
        ``random.seed(1)``'s stream)."""
        rng = random.Random(0)  # the same stream as random.seed(0)
        lo, hi = self.input_len
        prompts = [
            [rng.randint(0, 10000) for _ in range(rng.randint(lo, hi))] for _ in range(self.num_prompts)
        ]
        prefix_rng = random.Random(1)
        prefix = [prefix_rng.randint(0, 10000) for _ in range(self.prefix_len)]
        return [prefix + prompt for prompt in prompts[: num_prompts or self.num_prompts]]

    @property
    def max_model_len(self) -> int:
        return self.prefix_len + self.input_len[1] + self.output_len


def _config(name: str) -> str:
    return os.path.normpath(os.path.join(CONFIG_DIR, name))


WORKLOADS = {
    "W1": Workload("W1", _config("qwen3-0.6b"), 256, (100, 1024), 256),
    "W2": Workload("W2", _config("llama-3.1-8b"), 1000, (1024, 1024), 128),
    "W3": Workload("W3", _config("llama-3.1-8b"), 1, (128, 128), 256),
    "W5": Workload("W5", _config("qwen3-30b-a3b"), 512, (100, 1024), 256),
    # A hybrid (Gated DeltaNet + attention) model: docs/hybrid_models.md.
    "W6": Workload("W6", _config("qwen3-next-2b"), 256, (100, 1024), 256),
    # Multi-head latent attention (MLA) and shared experts, on W1's requests: benchmarks/README.md.
    "W7": Workload("W7", _config("deepseek-v2-lite"), 256, (100, 1024), 256),
}
