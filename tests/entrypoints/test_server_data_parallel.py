"""``pagedllm serve --data-parallel-size 2`` on the CPU: two engine processes behind one server.
Through the official openai client a batch gets one engine's greedy tokens, both replicas serve
(each one's counters, labelled ``engine``, move), and when a replica dies the requests in flight
fail within seconds, /health stops answering 200 and the server exits non-zero (vLLM's
behaviour)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
PROMPTS = [[5, 17, 3, 99, 42], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [30, 31], [8, 8, 8, 8], [150, 2, 77]]


@pytest.fixture(scope="module")
def server(launch_server, tiny_server_args):
    return launch_server([*tiny_server_args, "--data-parallel-size", "2", "--enable-prefix-caching"])


def engine_pids(server_pid: int) -> list[int]:
    """The server's engine processes: the children multiprocessing's spawn started."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def per_engine(server, name: str) -> dict[str, float]:
    """A metric's sample per ``engine`` label."""
    _, _, body = server.request("GET", "/metrics")
    pattern = re.compile(rf'^{re.escape(name)}{{[^}}]*engine="(\d+)"[^}}]*}} (\S+)$', re.M)
    return {engine: float(value) for engine, value in pattern.findall(body.decode())}


def wait_unhealthy(server, timeout: float) -> bool:
    """Whether /health stops answering 200 (503, or the server gone) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if server.request("GET", "/health")[0] == 503:
                return True
        except OSError:
            return True  # the server has closed its port on its way out
        time.sleep(0.05)
    return False


def test_a_batch_gets_one_engines_greedy_tokens_from_both_replicas(server, tiny_server_args):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    response = client.completions.create(
        model=model,
        prompt=PROMPTS,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    # Without a tokenizer each token comes back as "token_id:N".
    served = [[int(t.split(":")[1]) for t in choice.logprobs.tokens] for choice in response.choices]

    one_engine = LLM(tiny_server_args[0], device="cpu", max_model_len=64, swap_space=0.01)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = one_engine.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    assert served == [o.outputs[0].token_ids for o in expected]

    # The six requests arrived together: the router spread them, and each replica computed its
    # share of the prompts and outputs.
    server.wait_until_idle()
    prompt_tokens = per_engine(server, "pagedllm:prompt_tokens_total")
    generation_tokens = per_engine(server, "pagedllm:generation_tokens_total")
    assert set(prompt_tokens) == {"0", "1"} and all(v > 0 for v in prompt_tokens.values())
    assert sum(prompt_tokens.values()) == sum(map(len, PROMPTS))
    assert set(generation_tokens) == {"0", "1"} and all(v > 0 for v in generation_tokens.values())
    assert sum(generation_tokens.values()) == len(PROMPTS) * MAX_TOKENS
    # Both replicas' caches are counted, and every block is free again.
    blocks = per_engine(server, "pagedllm:num_gpu_blocks")
    assert set(blocks) == {"0", "1"}
    assert per_engine(server, "pagedllm:num_free_gpu_blocks") == blocks


def test_each_conversation_returns_to_the_replica_that_caches_it(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    # Two conversations of four full 16-token blocks each, started together: one per replica.
    turns1 = [[(7 * c + i) % 150 + 1 for i in range(64)] for c in range(2)]
    client.completions.create(model=model, prompt=turns1, max_tokens=4, temperature=0)
    server.wait_until_idle()
    assert all(rate == 0 for rate in per_engine(server, "pagedllm:prefix_cache_hit_rate").values())
    # Each second turn (its first turn, then more) comes alone to an idle server: by load alone
    # both would go to replica 0; by prefix each goes where its first turn's blocks are cached.
    for turn1 in turns1:
        client.completions.create(model=model, prompt=[*turn1, *range(1, 17)], max_tokens=4, temperature=0)
    server.wait_until_idle()
    hit_rates = per_engine(server, "pagedllm:prefix_cache_hit_rate")
    assert set(hit_rates) == {"0", "1"} and all(rate > 0 for rate in hit_rates.values()), hit_rates


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data-parallel-size", "0"], "data_parallel_size must be an int >= 1, got 0"),
        (["--data-parallel-size", "2", "--no-engine-process"], "data_parallel_size=2: one engine"),
    ],
)
def test_bad_sizes_are_refused_before_any_engine_starts(tiny_server_args, flags, message):
    command = [sys.executable, "-m", "pagedllm", "serve", *tiny_server_args, *flags, "--port", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"pagedllm serve: {message}" in result.stderr
    assert "ready" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the engine processes through /proc")
def test_a_dead_replica_fails_requests_and_the_server_exits(server):
    pids = engine_pids(server.process.pid)
    assert len(pids) == 2
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    started = threading.Barrier(3)
    failed_at: list[float] = []

    def stream_until_failure(prompt: list[int]) -> None:
        stream = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=1400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        try:
            for i, _ in enumerate(stream):
                if i == 0:
                    started.wait(30)
        except Exception:
            failed_at.append(time.monotonic())

    # Two long streams: one on each replica (the second goes to the less loaded).
    threads = [threading.Thread(target=stream_until_failure, args=([i + 1] * 5,)) for i in range(2)]
    for thread in threads:
        thread.start()
    started.wait(30)
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.monotonic()
    assert wait_unhealthy(server, timeout=10.0), server.log_tail()
    for thread in threads:
        thread.join(30)
    # Both streams failed (the dead replica's and the live one's: the engine is dead), in seconds.
    assert len(failed_at) == 2, server.log_tail()
    assert max(failed_at) - killed_at < 10
    try:
        returncode = server.process.wait(20)
    except Exception:
        pytest.fail(f"the server kept running after a replica died:\n{server.log_tail()}")
    assert returncode != 0
    log = server.log_tail()
    assert "the engine stopped serving" in log and "data-parallel engine 1 of 2" in log
