"""The server under load on the CPU with a tiny random model: 200 concurrent streams, clients
that drop their streams mid-way, and ``pagedllm bench serve`` (W4, a few requests); then, on the
same server, edge cases: logit_bias keys that only look like token ids, and a non-streaming
request in flight when the server shuts down."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import socket
import threading
import time

import aiohttp
import openai
import pytest

from pagedllm.entrypoints.bench import serve as bench_serve

NUM_CONCURRENT = 200
NUM_DROPPED = 50
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def server(launch_server, tiny_server_args):
    return launch_server(tiny_server_args)


@pytest.fixture(scope="module")
def model(server) -> str:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none").models.list().data[0].id


def random_prompts(num_prompts: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(4, 24))] for _ in range(num_prompts)]


def test_200_concurrent_streams_all_complete_and_free_every_block(server, model, tiny_vocab_size):
    max_tokens = [8 + i % 17 for i in range(NUM_CONCURRENT)]

    async def stream_one(client: openai.AsyncOpenAI, prompt: list[int], num_tokens: int) -> tuple[int, str]:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=num_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        finish_reason, usage = None, None
        async for chunk in stream:
            for choice in chunk.choices:
                finish_reason = choice.finish_reason or finish_reason
            usage = chunk.usage or usage
        return usage.completion_tokens, finish_reason

    async def main() -> list[tuple[int, str]]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        prompts = random_prompts(NUM_CONCURRENT, tiny_vocab_size)
        runs = [stream_one(client, prompt, n) for prompt, n in zip(prompts, max_tokens)]
        results = await asyncio.wait_for(asyncio.gather(*runs), TIMEOUT_S)
        await client.close()
        return results

    results = asyncio.run(main())
    assert results == [(n, "length") for n in max_tokens]
    metrics = server.wait_until_idle()
    assert metrics["pagedllm:num_free_gpu_blocks"] == metrics["pagedllm:num_gpu_blocks"]
    assert metrics["pagedllm:num_requests_running"] == 0


def test_dropped_streams_are_aborted_and_free_their_blocks(server, model, tiny_vocab_size):
    aborted_before = server.metrics()["pagedllm:num_aborted_requests_total"]

    async def drop_after_two_chunks(session: aiohttp.ClientSession, prompt: list[int]) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": 1000, "ignore_eos": True, "stream": True}
        response = await session.post(server.url + "/v1/completions", json=body)
        assert response.status == 200
        num_chunks = 0
        async for line in response.content:
            num_chunks += line.startswith(b"data: ")
            if num_chunks == 2:
                break
        # Close the connection mid-stream, as a client that goes away does.
        response.close()
        return num_chunks

    async def main() -> list[int]:
        async with aiohttp.ClientSession() as session:
            runs = [drop_after_two_chunks(session, p) for p in random_prompts(NUM_DROPPED, tiny_vocab_size)]
            return await asyncio.wait_for(asyncio.gather(*runs), TIMEOUT_S)

    assert asyncio.run(main()) == [2] * NUM_DROPPED
    metrics = server.wait_until_idle()
    assert metrics["pagedllm:num_aborted_requests_total"] - aborted_before == NUM_DROPPED
    assert metrics["pagedllm:num_free_gpu_blocks"] == metrics["pagedllm:num_gpu_blocks"]
    assert server.request("GET", "/health")[0] == 200
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}
    status, _, response = server.request("POST", "/v1/completions", body)
    assert status == 200 and json.loads(response)["usage"]["completion_tokens"] == 4


def test_w4_requests_are_deterministic_and_in_range():
    requests = bench_serve.w4_requests()
    assert len(requests) == 500 and requests == bench_serve.w4_requests()
    assert all(100 <= len(r.prompt_token_ids) <= 1024 and 32 <= r.output_len <= 512 for r in requests)
    assert all(0 <= t <= 10000 for r in requests for t in r.prompt_token_ids)
    # Fewer prompts take a prefix of the same workload; a small vocabulary folds the ids.
    assert bench_serve.w4_requests(3) == requests[:3]
    folded = bench_serve.w4_requests(3, vocab_size=160)
    assert [len(r.prompt_token_ids) for r in folded] == [len(r.prompt_token_ids) for r in requests[:3]]
    assert all(0 <= t < 160 for r in folded for t in r.prompt_token_ids)


def test_bench_serve_against_the_server(server, tiny_vocab_size, tmp_path, capsys):
    result_file, plot_file = tmp_path / "results.json", tmp_path / "latency.png"
    parser = bench_serve.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--base-url",
            server.url,
            "--num-prompts",
            "4",
            "--request-rate",
            "8",
            "inf",
            "--vocab-size",
            str(tiny_vocab_size),
            "--result-file",
            str(result_file),
            "--plot-file",
            str(plot_file),
        ]
    )
    bench_serve.main(args)
    results = json.loads(result_file.read_text())["results"]
    assert [r["request_rate"] for r in results] == [8.0, "inf"]
    for summary in results:
        assert (summary["completed"], summary["failed"], summary["incomplete"]) == (4, 0, 0)
        assert summary["output_throughput"] > 0 and summary["errors"] == []
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert 0 < summary[key]["p50"] <= summary[key]["p90"] <= summary[key]["p99"]
    assert "TTFT" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    assert plot_file.read_bytes().startswith(b"\x89PNG")


def test_random_lengths_replace_w4s_and_allow_more_prompts():
    requests = bench_serve.w4_requests(600, input_len=7, output_len=5)
    assert len(requests) == 600
    assert all(len(r.prompt_token_ids) == 7 and r.output_len == 5 for r in requests)
    only_output = bench_serve.w4_requests(3, output_len=9)
    assert [r.output_len for r in only_output] == [9, 9, 9]
    assert all(100 <= len(r.prompt_token_ids) <= 1024 for r in only_output)
    with pytest.raises(ValueError, match="random_input_len must be at least 1"):
        bench_serve.w4_requests(3, input_len=0)
    with pytest.raises(ValueError, match="num_prompts must be in"):
        bench_serve.w4_requests(501)


def test_max_concurrency_bounds_the_requests_in_flight_and_a_bar_shows_progress(server, model, capsys):
    requests = bench_serve.w4_requests(6, vocab_size=160, input_len=8, output_len=16)
    results, _ = asyncio.run(
        bench_serve.run_at_rate(
            server.url + "/v1/completions", model, requests, float("inf"), {}, 60.0, 2, show_progress=True
        )
    )
    assert all(r.success for r in results) and all(r.num_output_tokens == 16 for r in results)
    # Every moment a request was sent, at most two were in flight.
    spans = [(r.start, r.start + r.latency) for r in results]
    for start, _ in spans:
        assert sum(s <= start < e for s, e in spans) <= 2, spans
    assert "6/6" in capsys.readouterr().err


@pytest.mark.slow
def test_shutdown_with_open_streams_does_not_hang(launch_server, tiny_server_args, tiny_vocab_size):
    server = launch_server(tiny_server_args)

    async def read_stream(session: aiohttp.ClientSession, prompt: list[int], started: asyncio.Event) -> None:
        body = {"prompt": prompt, "max_tokens": 1400, "ignore_eos": True, "stream": True}
        async with session.post(server.url + "/v1/completions", json=body) as response:
            async for _ in response.content:
                started.set()

    async def main() -> float:
        async with aiohttp.ClientSession() as session:
            events = [asyncio.Event() for _ in range(20)]
            prompts = random_prompts(len(events), tiny_vocab_size)
            streams = [asyncio.ensure_future(read_stream(session, p, e)) for p, e in zip(prompts, events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), TIMEOUT_S)
            start = time.monotonic()
            server.process.send_signal(signal.SIGINT)
            await asyncio.to_thread(server.process.wait, TIMEOUT_S)
            await asyncio.gather(*streams, return_exceptions=True)
            return time.monotonic() - start

    # uvicorn lets open responses run for its graceful timeout (5 s), then cancels them.
    assert asyncio.run(main()) < 15
    assert server.process.returncode == 0, server.log_tail()


NUM_IDLE = 300
NUM_SLOWLORIS = 300
LIMIT = 8
# The longest a request may wait while idle and slow sockets are open: seconds, where a server
# that counted those sockets against its limit answered 503 for as long as they stayed open.
ANSWER_BOUND_S = 2.0


def _timed_get(server, path: str) -> tuple[int, float]:
    start = time.perf_counter()
    status = server.request("GET", path)[0]
    return status, time.perf_counter() - start


@pytest.mark.slow
def test_idle_and_slowloris_sockets_neither_starve_requests_nor_stay_open(launch_server, tiny_server_args):
    """Idle sockets and sockets that trickle headers never count against --limit-concurrency and
    are closed after the header timeout; real requests in progress still do count."""
    from pagedllm.entrypoints.openai.api_server import HEADER_READ_TIMEOUT_S

    server = launch_server([*tiny_server_args, "--limit-concurrency", str(LIMIT)])
    host, port = server.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(NUM_IDLE)]
    slow = [socket.create_connection((host, int(port))) for _ in range(NUM_SLOWLORIS)]
    opened = time.monotonic()
    try:
        for sock in slow:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        for path in ("/health", "/v1/models", "/health", "/v1/models"):
            status, seconds = _timed_get(server, path)
            assert status == 200 and seconds < ANSWER_BOUND_S, (path, status, seconds)
            for sock in slow[:50]:
                sock.sendall(b"X-Slow: 1\r\n")  # a byte now and then: uvicorn's keep-alive timer stops
        # LIMIT requests whose bodies never come are in progress; one more is refused, /health is not.
        partial = []
        for _ in range(LIMIT):
            sock = socket.create_connection((host, int(port)))
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{"
            )
            partial.append(sock)
        time.sleep(0.5)
        status, _, body = server.request("GET", "/v1/models")
        assert status == 503 and json.loads(body)["error"]["code"] == "server_busy", body
        assert _timed_get(server, "/health")[0] == 200
        for sock in partial:
            sock.close()
        time.sleep(0.5)
        assert server.request("GET", "/v1/models")[0] == 200
        # Every idle and slow socket is closed by the server once the header timeout passes.
        for sock in idle[:20] + slow[:20]:
            sock.settimeout(max(HEADER_READ_TIMEOUT_S + 5 - (time.monotonic() - opened), 0.1))
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1024) == b""
        assert time.monotonic() - opened < HEADER_READ_TIMEOUT_S + 5
    finally:
        for sock in idle + slow:
            sock.close()


# --- edge cases on the module's server (the last test stops it) --------------------------------


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
