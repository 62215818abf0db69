"""The grammar extension's build (about a minute, once per machine) starts with the server and is
no request's compile time: a constrained request during it gets 503 ``grammar_building``, and one
after it is answered."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

BUILD_TIMEOUT_S = 300


@pytest.mark.slow
def test_a_constrained_request_during_the_build_gets_503_then_succeeds(
    launch_server, tiny_llama_with_tokenizer: str, tmp_path: Path
):
    # An empty cache: the extension is built afresh. The CPU kernels' build is left out (another
    # minute); the tiny model runs its PyTorch paths.
    env = {"PAGEDLLM_CACHE_DIR": str(tmp_path / "cache"), "PAGEDLLM_CPU_KERNELS": "0"}
    server = launch_server([tiny_llama_with_tokenizer, "--swap-space", "0.01"], env=env)
    body = {"prompt": "Answer:", "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}}
    status, _, answer = server.request("POST", "/v1/completions", body)
    assert status == 503, answer
    assert b'"code":"grammar_building"' in answer and b"being built" in answer
    # Unconstrained requests are served meanwhile.
    assert server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while status == 503 and time.monotonic() < deadline:
        time.sleep(2.0)
        status, _, answer = server.request("POST", "/v1/completions", body)
    assert status == 200, answer
    assert b'"text":"yes"' in answer or b'"text":"no"' in answer
    assert "building pagedllm's grammar extension" in server.log_tail(20000)
