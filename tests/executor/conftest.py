"""What the tensor-parallel tests of every executor share: prompts, the free-block check, and a
rank killed in the middle of a batch."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.executor.abstract import ExecutorDeadError

# A dead rank must fail the requests within this many seconds.
FAILURE_DEADLINE_S = 10


@pytest.fixture(scope="session")
def random_prompts() -> Callable[..., list[list[int]]]:
    """random_prompts(n, vocab_size, lo=1, hi=40, seed=0): n prompts of lo..hi random token ids."""

    def make(n: int, vocab_size: int, lo: int = 1, hi: int = 40, seed: int = 0) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]

    return make


@pytest.fixture(scope="session")
def assert_every_block_free() -> Callable[[LLMEngine], None]:
    def check(engine: LLMEngine) -> None:
        stats = engine.get_stats()
        assert not engine.has_unfinished_requests()
        assert (stats.num_free_gpu_blocks, stats.num_free_cpu_blocks) == (
            stats.num_gpu_blocks,
            stats.num_cpu_blocks,
        )

    return check


@pytest.fixture(scope="session")
def kill_a_rank_mid_batch(random_prompts) -> Callable[[LLMEngine], None]:
    """kill(engine): start a batch, SIGKILL rank 1, and check that the next steps raise
    ExecutorDeadError naming it within FAILURE_DEADLINE_S seconds."""

    def kill(engine: LLMEngine) -> None:
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        for i, prompt in enumerate(random_prompts(3, engine.config.model_config.vocab_size)):
            engine.add_request(f"long{i}", prompt_token_ids=prompt, sampling_params=long)
        engine.step()
        os.kill(engine.executor.worker_pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ExecutorDeadError, match="rank 1"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < FAILURE_DEADLINE_S

    return kill
