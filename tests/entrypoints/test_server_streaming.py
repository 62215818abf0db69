"""The server with attention sinks: a completion may ask for more tokens than max_model_len, and
gets them (StreamingLLM's bounded cache); without sinks the same request is a 400."""

from __future__ import annotations

import json

import pytest

MAX_MODEL_LEN = 128


@pytest.mark.slow
def test_sinks_let_a_completion_run_past_max_model_len(launch_server, tiny_model_dir):
    flags = [tiny_model_dir, "--max-model-len", str(MAX_MODEL_LEN), "--swap-space", "0.1"]
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 3 * MAX_MODEL_LEN, "ignore_eos": True, "temperature": 0}
    sinks = launch_server([*flags, "--sliding-window", "32", "--attention-sinks", "4"])
    status, _, raw = sinks.request("POST", "/v1/completions", {"model": _model(sinks), **body})
    assert status == 200, raw
    response = json.loads(raw)
    assert response["usage"]["completion_tokens"] == 3 * MAX_MODEL_LEN
    assert response["choices"][0]["finish_reason"] == "length"

    plain = launch_server(flags)
    status, _, raw = plain.request("POST", "/v1/completions", {"model": _model(plain), **body})
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"


def _model(server) -> str:
    status, _, raw = server.request("GET", "/v1/models")
    assert status == 200
    return json.loads(raw)["data"][0]["id"]
