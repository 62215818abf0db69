"""The server when model steps fail: a request that fails the step gets an error and the others
are served as if nothing happened; when every step fails, the engine gives up and the server
exits non-zero, for its supervisor to restart it.

The server runs ``pagedllm serve`` with a ``sitecustomize`` module on its path, which every process
of the server imports at startup (the engine's own process included): it makes every step raise
that sends a prompt holding POISON (the poison request is sent in full at each of its steps: it
never gets past its first), and every step at all once a prompt holding BREAK was seen.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from pathlib import Path

import pytest

POISON = 150
BREAK = 151
FAILING_STEPS = f"""
from pagedllm.executor.uniproc_executor import UniProcExecutor

execute_model = UniProcExecutor.execute_model
broken = []


def failing(self, scheduler_output):
    tokens = {{t for data in scheduler_output.scheduled_new_reqs for t in data.prompt_token_ids}}
    if {BREAK} in tokens:
        broken.append(True)
    if broken or {POISON} in tokens:
        raise RuntimeError("injected step failure")
    return execute_model(self, scheduler_output)


UniProcExecutor.execute_model = failing
"""


@pytest.fixture(scope="module")
def server(launch_server, tiny_server_args, tmp_path_factory):
    site = tmp_path_factory.mktemp("failing-steps")
    (site / "sitecustomize.py").write_text(FAILING_STEPS)
    # The repository too: sitecustomize runs before ``-m`` puts the working directory on the path.
    repo = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(filter(None, [str(site), str(repo), os.environ.get("PYTHONPATH")]))
    # The torch backend: batch invariant, so a request's tokens do not depend on its neighbours.
    args = [*tiny_server_args, "--attention-backend", "torch"]
    return launch_server(args, env={"PYTHONPATH": path})


def complete(server, prompt: list[int]) -> tuple[int, dict]:
    """(status, body) of a greedy completion of 8 tokens, each token's logprob asked for."""
    model = json.loads(server.request("GET", "/v1/models")[2])["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, _, data = server.request("POST", "/v1/completions", {**body, "logprobs": 0})
    return status, json.loads(data)


def token_ids(body: dict) -> list[int]:
    # Without a tokenizer each token comes back as "token_id:N".
    return [int(token.split(":")[1]) for token in body["choices"][0]["logprobs"]["tokens"]]


def test_a_poison_request_gets_an_error_and_the_requests_beside_it_are_served(server):
    prompts = [[1, 2, 3], [4, 5, 6, 7], [POISON, 2, 3], [8, 9]]
    alone = [token_ids(complete(server, prompt)[1]) for prompt in prompts if POISON not in prompt]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda prompt: complete(server, prompt), prompts))
    status, poisoned = together.pop(2)
    assert status == 500 and "injected step failure" in poisoned["error"]["message"]
    assert [status for status, _ in together] == [200] * 3
    assert [token_ids(body) for _, body in together] == alone
    assert server.request("GET", "/health")[0] == 200
    metrics = server.wait_until_idle()
    assert metrics["pagedllm:num_failed_requests_total"] == 1
    assert metrics["pagedllm:num_free_gpu_blocks"] == metrics["pagedllm:num_gpu_blocks"]


def test_when_every_step_fails_the_server_exits_non_zero(server):
    """Last in the module: it ends the server."""
    deadline = time.monotonic() + 60
    while server.process.poll() is None and time.monotonic() < deadline:
        try:
            status, _ = complete(server, [BREAK, 1, 2])
        except OSError:
            continue  # going away
        assert status in (500, 503)
    try:
        returncode = server.process.wait(10)
    except Exception:
        pytest.fail(f"the server kept running with a broken engine:\n{server.log_tail()}")
    assert returncode != 0
    log = server.log_tail()
    assert "model steps fail whatever runs in them" in log and "the engine stopped serving" in log
