"""Edge cases against a real server on loopback: logit_bias keys that only look like token ids,
and a non-streaming request in flight when the server shuts down."""

from __future__ import annotations

import json
import threading
import time

import pytest


@pytest.fixture(scope="module")
def server(launch_server, tiny_server_args: list[str]):
    return launch_server(tiny_server_args)


@pytest.mark.parametrize("key", ["\u00b2", "\u0661\u0662", "five"])
def test_a_logit_bias_key_that_is_no_ascii_token_id_is_a_400_naming_logit_bias(server, key):
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "logit_bias": {key: 5}}
    status, _, answer = server.request("POST", "/v1/completions", body)
    error = json.loads(answer)["error"]
    assert status == 400 and error["param"] == "logit_bias", error
    assert error["message"].startswith("logit_bias must be keyed by token ids"), error


def test_a_non_streaming_request_at_shutdown_gets_503(server):
    """Last in the module: it stops the server."""
    result: list[tuple[int, bytes]] = []
    body = {"prompt": [1, 2, 3], "max_tokens": 1400, "ignore_eos": True}

    def send() -> None:
        status, _, answer = server.request("POST", "/v1/completions", body)
        result.append((status, answer))

    sender = threading.Thread(target=send)
    sender.start()
    deadline = time.monotonic() + 30
    while server.metrics()["pagedllm:num_requests_running"] < 1:
        assert time.monotonic() < deadline and sender.is_alive(), result
        time.sleep(0.02)
    server.stop()
    sender.join(30)
    [(status, answer)] = result
    error = json.loads(answer)["error"]
    assert status == 503 and error["code"] == "engine_unavailable", error
    assert "shutting down" in error["message"]
    assert server.process.returncode == 0
