"""Hostile requests against the real server (``pagedllm serve`` with a tiny random Llama that has
the embedded SmolLM2's tokenizer and chat template: every refusal here is the server's and the
tokenizer's, and the tiny model makes each victim's tokens cheap).

Each case runs beside a victim: a streamed completion that must finish whole (every token, no
error event) while the hostile request is answered with a 4xx naming the field (or served, where
the input is legal). ``/health`` answers 200 after every case, and the server ends idle.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any

import pytest

API_KEY = "sk-hostile"
MAX_MODEL_LEN = 256  # the tiny model's max_position_embeddings
MAX_NUM_SEQS = 16
VICTIM_TOKENS = 8
VOCAB = 49152  # SmolLM2's tokenizer's


@pytest.fixture(scope="module")
def server(launch_server, tiny_llama_with_tokenizer):
    args = [tiny_llama_with_tokenizer, "--max-model-len", str(MAX_MODEL_LEN)]
    args += ["--max-num-seqs", str(MAX_NUM_SEQS), "--swap-space", "0.1"]
    return launch_server(args, api_key=API_KEY)


def _post_raw(server, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    all_headers = {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {API_KEY}",
        **(headers or {}),
    }
    connection.request("POST", path, body=body, headers=all_headers)
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, data


class Victim(threading.Thread):
    """A streamed completion of exactly VICTIM_TOKENS tokens; records what it got."""

    def __init__(self, server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.events: list[dict[str, Any]] = []
        self.error: str | None = None

    def run(self) -> None:
        body = {
            "prompt": "Once upon a time",
            "max_tokens": VICTIM_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            status, data = _post_raw(self.server, "/v1/completions", json.dumps(body).encode())
            if status != 200:
                self.error = f"status {status}: {data[:300]!r}"
                return
            lines = [line for line in data.decode().splitlines() if line.startswith("data: ")]
            if lines[-1] != "data: [DONE]":
                self.error = f"no [DONE]: {lines[-1]!r}"
            self.events = [json.loads(line[6:]) for line in lines[:-1]]
        except Exception as e:  # recorded, asserted by the test
            self.error = repr(e)

    def assert_whole(self) -> None:
        self.join(180)
        assert not self.is_alive(), "the victim stream never ended"
        assert self.error is None, self.error
        assert not any("error" in event for event in self.events), self.events
        finishes = [c["finish_reason"] for e in self.events for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"]
        assert self.events[-1]["usage"]["completion_tokens"] == VICTIM_TOKENS


def _completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Hello", "max_tokens": 4, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

# (id, path, body: dict or raw bytes, expected status, expected param (None: not checked)).
CASES = [
    ("seed-past-64-bits", "/v1/completions", _completion(seed=2**64), 400, "seed"),
    ("seed-below-int64", "/v1/completions", _completion(seed=-(2**63) - 1), 400, "seed"),
    ("seed-10e30", "/v1/completions", _completion(seed=10**30), 400, "seed"),
    (
        "stop-id-past-vocab-min-tokens",
        "/v1/completions",
        _completion(stop_token_ids=[VOCAB], min_tokens=2),
        400,
        "stop_token_ids",
    ),
    (
        "stop-id-10e30",
        "/v1/completions",
        _completion(stop_token_ids=[10**30], min_tokens=2),
        400,
        "stop_token_ids",
    ),
    ("prompt-id-10e30", "/v1/completions", _completion(prompt=[1, 10**30]), 400, "prompt"),
    ("prompt-id-negative", "/v1/completions", _completion(prompt=[-1]), 400, "prompt"),
    ("prompt-id-past-vocab", "/v1/completions", _completion(prompt=[VOCAB]), 400, "prompt"),
    ("n-over-max-num-seqs", "/v1/completions", _completion(n=MAX_NUM_SEQS + 1, temperature=1), 400, "n"),
    (
        "best-of-over-max-num-seqs",
        "/v1/completions",
        _completion(best_of=1000, temperature=1),
        400,
        "best_of",
    ),
    (
        "beam-width-over-max-num-seqs",
        "/v1/completions",
        _completion(use_beam_search=True, best_of=500, temperature=0),
        400,
        "best_of",
    ),
    (
        "temperature-infinity",
        "/v1/completions",
        b'{"prompt": "x", "temperature": Infinity}',
        400,
        "temperature",
    ),
    (
        "presence-penalty-nan",
        "/v1/completions",
        b'{"prompt": "x", "presence_penalty": NaN}',
        400,
        "presence_penalty",
    ),
    (
        "top-p-nan",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}',
        400,
        "top_p",
    ),
    (
        "frequency-penalty-minus-infinity",
        "/v1/completions",
        b'{"prompt": "x", "frequency_penalty": -Infinity}',
        400,
        "frequency_penalty",
    ),
    (
        "logit-bias-id-past-vocab",
        "/v1/completions",
        _completion(logit_bias={"99999999": 1}),
        400,
        "logit_bias",
    ),
    ("logit-bias-value-too-big", "/v1/completions", _completion(logit_bias={"5": 1000}), 400, "logit_bias"),
    ("logit-bias-key-not-a-number", "/v1/completions", _completion(logit_bias={"abc": 1}), 400, "logit_bias"),
    (
        "allowed-token-ids-past-vocab",
        "/v1/completions",
        _completion(allowed_token_ids=[10**9]),
        400,
        "allowed_token_ids",
    ),
    ("bad-words-empty-string", "/v1/completions", _completion(bad_words=[""]), 400, "bad_words"),
    (
        "too-many-stop-strings",
        "/v1/completions",
        _completion(stop=[f"s{i}" for i in range(100)]),
        400,
        "stop",
    ),
    ("huge-stop-string", "/v1/completions", _completion(stop=["x" * 10_000]), 400, "stop"),
    (
        "request-chat-template-in-kwargs",
        "/v1/chat/completions",
        _chat(chat_template_kwargs={"chat_template": "{% for i in range(10**9) %}x{% endfor %}"}),
        400,
        "chat_template",
    ),
    (
        "request-chat-template",
        "/v1/chat/completions",
        _chat(chat_template="{{ messages }}"),
        400,
        "chat_template",
    ),
    (
        "clashing-chat-template-kwargs",
        "/v1/chat/completions",
        _chat(chat_template_kwargs={"add_generation_prompt": False, "messages": []}),
        400,
        "chat_template_kwargs",
    ),
    ("lone-surrogate-in-prompt", "/v1/completions", b'{"prompt": "ab\\ud800cd", "max_tokens": 2}', 400, None),
    (
        "lone-surrogate-in-message",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        400,
        None,
    ),
    ("lone-surrogate-in-stop", "/v1/completions", b'{"prompt": "x", "stop": ["\\ud83d"]}', 400, None),
    ("invalid-json", "/v1/completions", b'{"prompt": "x", ', 400, None),
    ("body-not-an-object", "/v1/completions", b"[1, 2, 3]", 400, None),
    ("unknown-parameter", "/v1/completions", _completion(frobnicate=True), 400, "frobnicate"),
    ("unsupported-openai-parameter", "/v1/chat/completions", _chat(modalities=["audio"]), 400, "modalities"),
    (
        "unknown-role",
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages",
    ),
    ("tool-choice-without-tools", "/v1/chat/completions", _chat(tool_choice="required"), 400, "tool_choice"),
    (
        "auto-tool-choice-without-parser",
        "/v1/chat/completions",
        _chat(tools=TOOLS, tool_choice="auto"),
        400,
        "tool_choice",
    ),
    (
        "named-tool-not-in-tools",
        "/v1/chat/completions",
        _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        400,
        "tool_choice",
    ),
    (
        "tool-call-arguments-not-json",
        "/v1/chat/completions",
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "1"},
            ]
        },
        400,
        None,
    ),
    (
        "json-schema-that-does-not-compile",
        "/v1/chat/completions",
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            }
        ),
        400,
        "response_format",
    ),
    ("regex-that-does-not-compile", "/v1/completions", _completion(guided_regex="(("), 400, "guided_regex"),
    (
        "two-output-constraints",
        "/v1/completions",
        _completion(guided_regex="a+", guided_choice=["a"]),
        400,
        None,
    ),
    (
        "structured-outputs-unknown-key",
        "/v1/completions",
        _completion(structured_outputs={"foo": 1}),
        400,
        "structured_outputs",
    ),
    ("negative-max-tokens", "/v1/completions", _completion(max_tokens=-1), 400, "max_tokens"),
    ("min-tokens-over-max-tokens", "/v1/completions", _completion(min_tokens=10**6), 400, "min_tokens"),
    ("top-logprobs-100", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=100), 400, "top_logprobs"),
    ("logprobs-100", "/v1/completions", _completion(logprobs=100), 400, "logprobs"),
    ("prompt-logprobs-100", "/v1/completions", _completion(prompt_logprobs=100), 400, "prompt_logprobs"),
    (
        "prompt-over-max-model-len",
        "/v1/completions",
        _completion(prompt=[1] * (MAX_MODEL_LEN + 1)),
        400,
        "prompt",
    ),
    ("empty-prompt", "/v1/completions", _completion(prompt=[]), 400, "prompt"),
    ("empty-token-prompt", "/v1/completions", _completion(prompt=[[]]), 400, "prompt"),
    (
        "truncate-prompt-tokens-zero",
        "/v1/completions",
        _completion(truncate_prompt_tokens=0),
        400,
        "truncate_prompt_tokens",
    ),
    ("n-not-a-number", "/v1/completions", _completion(n="many"), 400, "n"),
    (
        "stream-options-without-stream",
        "/v1/completions",
        _completion(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    (
        "continue-final-message-with-generation-prompt",
        "/v1/chat/completions",
        _chat(continue_final_message=True),
        400,
        "continue_final_message",
    ),
    ("wrong-model", "/v1/completions", _completion(model="gpt-5"), 404, "model"),
    ("detokenize-ids-past-vocab", "/detokenize", {"tokens": [1, 10**12]}, 400, "tokens"),
    ("tokenize-nothing", "/tokenize", {}, 400, "prompt"),
]


@pytest.mark.parametrize(
    "path, body, status, param", [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
def test_hostile_request_is_refused_and_hurts_nobody(server, path, body, status, param):
    victim = Victim(server)
    victim.start()
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got_status, data = _post_raw(server, path, raw)
    assert got_status == status, data[:500]
    error = json.loads(data)["error"]
    assert isinstance(error["message"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    victim.assert_whole()
    assert server.request("GET", "/health")[0] == 200


def test_the_same_x_request_id_twice_at_once_serves_both(server):
    victim = Victim(server)
    victim.start()
    results: list[int] = []
    body = json.dumps(_completion(max_tokens=6, temperature=0)).encode()

    def send() -> None:
        results.append(_post_raw(server, "/v1/completions", body, {"X-Request-Id": "same-id"})[0])

    threads = [threading.Thread(target=send) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == [200, 200]
    victim.assert_whole()


def test_a_lowercase_bearer_scheme_is_accepted_and_a_wrong_key_is_not(server):
    ok = server.request("GET", "/v1/models", headers={"Authorization": f"bearer {API_KEY}"}, authorize=False)
    assert ok[0] == 200
    wrong = server.request("GET", "/v1/models", headers={"Authorization": "Bearer nope"}, authorize=False)
    assert wrong[0] == 401 and json.loads(wrong[2])["error"]["code"] == "invalid_api_key"


def test_many_prompts_are_aborted_as_soon_as_the_client_leaves(server):
    victim = Victim(server)
    victim.start()
    body = json.dumps({"prompt": [[1, 2, 3]] * 2000, "max_tokens": 64, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request(
        "POST",
        "/v1/completions",
        body=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    time.sleep(2.0)
    connection.close()
    victim.assert_whole()
    metrics = server.wait_until_idle(timeout=60)
    assert metrics["pagedllm:num_requests_running"] == 0 and metrics["pagedllm:num_requests_waiting"] == 0
    # Far fewer than 2000 x 64 tokens were generated for nobody.
    assert metrics.get("pagedllm:generation_tokens_total", 0) < 2000 * 64 / 4


def test_head_health_and_the_server_ends_idle_with_every_block_free(server):
    assert server.request("HEAD", "/health")[0] == 200
    metrics = server.wait_until_idle()
    assert metrics["pagedllm:num_free_gpu_blocks"] == metrics["pagedllm:num_gpu_blocks"]


# Just under the 1 MiB body limit once wrapped in JSON: about a second of the tokenizer's time.
BIG_TEXT = ("hello world " * 90_000)[:1_000_000]
# The longest /health may take while big prompts are tokenized (on the event loop it took 8 s).
HEALTH_BOUND_S = 1.0


def _health_latencies(server, until: threading.Event) -> list[float]:
    latencies = []
    while not until.is_set():
        start = time.perf_counter()
        assert server.request("GET", "/health")[0] == 200
        latencies.append(time.perf_counter() - start)
        time.sleep(0.05)
    return latencies


@pytest.mark.parametrize(
    "path, body",
    [("/tokenize", {"prompt": "Hello"}), ("/detokenize", {"tokens": [1, 2]})],
    ids=["tokenize", "detokenize"],
)
def test_tokenize_and_detokenize_need_the_api_key(server, path, body):
    got = server.request("POST", path, body, authorize=False)
    assert got[0] == 401 and json.loads(got[2])["error"]["code"] == "invalid_api_key"
    assert server.request("POST", path, body)[0] == 200


def test_big_prompts_to_tokenize_and_completions_stall_neither_health_nor_streams(server):
    victim = Victim(server)
    victim.start()
    done = threading.Event()
    results: list[tuple[str, int, bytes]] = []

    def send(path: str, body: dict[str, Any]) -> None:
        status, data = _post_raw(server, path, json.dumps(body).encode())
        results.append((path, status, data))

    senders = [threading.Thread(target=send, args=("/tokenize", {"prompt": BIG_TEXT})) for _ in range(4)]
    senders.append(threading.Thread(target=send, args=("/v1/completions", _completion(prompt=BIG_TEXT))))
    senders.append(
        threading.Thread(
            target=send,
            args=("/v1/chat/completions", _chat(messages=[{"role": "user", "content": BIG_TEXT}])),
        )
    )
    watcher_result: list[list[float]] = []
    watcher = threading.Thread(target=lambda: watcher_result.append(_health_latencies(server, done)))
    watcher.start()
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(120)
    done.set()
    watcher.join(30)
    victim.assert_whole()
    by_path = {path: [(status, data) for p, status, data in results if p == path] for path, *_ in results}
    assert [status for status, _ in by_path["/tokenize"]] == [200] * 4
    assert json.loads(by_path["/tokenize"][0][1])["count"] > 100_000
    for path, param in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        status, data = by_path[path][0]
        error = json.loads(data)["error"]
        # Refused by its length in characters, before it was tokenized.
        assert status == 400 and error["param"] == param and "characters" in error["message"], error
    assert max(watcher_result[0]) < HEALTH_BOUND_S, sorted(watcher_result[0])[-5:]


def test_shutdown_ends_open_streams_with_an_error_event(server):
    """Last in the module: it stops the server."""
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"prompt": "Once", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "stream": True}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    response = connection.getresponse()
    first = response.readline()
    assert first.startswith(b"data: {")
    server.stop()
    rest = [line.decode().strip() for line in response.read().splitlines() if line.strip()]
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert "shutting down" in error["message"]
    assert server.process.returncode == 0
