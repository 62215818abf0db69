"""``pagedllm serve --tensor-parallel-size 2`` on the CPU (two gloo ranks): the official openai
client gets one rank's tokens; when a rank dies the server reports it and exits non-zero."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
import pytest

from pagedllm import LLM, SamplingParams

MAX_TOKENS = 12


# Slow (~25 s): a server with two rank processes, and one killed.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(launch_server, tiny_server_args):
    return launch_server([*tiny_server_args, "--tensor-parallel-size", "2"])


def spawned_children(pid: int) -> list[int]:
    """The children of ``pid`` that multiprocessing's spawn started."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def rank_pids(server_pid: int) -> list[int]:
    """The server's rank processes: started by its engine process, which the server started."""
    (engine_pid,) = spawned_children(server_pid)
    return spawned_children(engine_pid)


def test_completions_equal_one_rank_offline(server, tiny_server_args):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    prompts = [[5, 17, 3, 99, 42], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    response = client.completions.create(
        model=model,
        prompt=prompts,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    # Without a tokenizer each token comes back as "token_id:N".
    served = [[int(t.split(":")[1]) for t in choice.logprobs.tokens] for choice in response.choices]

    one_rank = LLM(tiny_server_args[0], device="cpu", max_model_len=64, swap_space=0.01)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = one_rank.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert served == [o.outputs[0].token_ids for o in expected]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the rank processes through /proc")
def test_a_dead_rank_makes_the_server_unhealthy_and_exit_non_zero(server):
    pids = rank_pids(server.process.pid)
    assert len(pids) == 2
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    try:
        returncode = server.process.wait(20)
    except Exception:
        pytest.fail(f"the server kept running after a rank died:\n{server.log_tail()}")
    assert returncode != 0
    assert time.monotonic() - start < 20
    log = server.log_tail()
    assert "the engine stopped serving" in log and "died" in log
