"""Fixtures that start the real server (``python -m pagedllm serve``, the user's command) in a
subprocess on a free loopback port, wait for /health, and always stop it at the end."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

STARTUP_TIMEOUT_S = 180
SHUTDOWN_TIMEOUT_S = 20
# Long enough for W4's prompts (up to 1024 tokens) plus outputs (up to 512).
TINY_MAX_MODEL_LEN = 1536
TINY_VOCAB_SIZE = 160


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A running server: its URL, its log, and small raw-HTTP helpers for tests."""

    def __init__(self, process: subprocess.Popen, port: int, log_path: Path, api_key: str | None) -> None:
        self.process = process
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.api_key = api_key

    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict | None = None,
        headers: dict[str, str] | None = None,
        authorize: bool = True,
    ) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) of one request, with the API key unless ``authorize`` is False;
        HTTP errors are returned, not raised."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        all_headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.api_key and authorize:
            all_headers["Authorization"] = f"Bearer {self.api_key}"
        all_headers.update(headers or {})
        request = urllib.request.Request(self.url + path, data=data, headers=all_headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, _lower_keys(response.headers), response.read()
        except urllib.error.HTTPError as e:
            return e.code, _lower_keys(e.headers), e.read()

    def metrics(self) -> dict[str, float]:
        """Prometheus samples by name, summed over labels (``_bucket`` samples left out)."""
        _, _, body = self.request("GET", "/metrics")
        samples: dict[str, float] = {}
        for line in body.decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name_and_labels, value = line.rsplit(" ", 1)
            name = name_and_labels.split("{", 1)[0]
            if not name.endswith("_bucket"):
                samples[name] = samples.get(name, 0.0) + float(value)
        return samples

    def wait_until_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and every KV block is free; return them."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            idle = (
                metrics["pagedllm:num_requests_running"] == 0
                and metrics["pagedllm:num_requests_waiting"] == 0
                and metrics["pagedllm:num_free_gpu_blocks"] == metrics["pagedllm:num_gpu_blocks"]
            )
            if idle or time.monotonic() > deadline:
                return metrics
            time.sleep(0.1)

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _lower_keys(headers: Any) -> dict[str, str]:
    return {key.lower(): value for key, value in headers.items()}


def start_server(
    args: list[str],
    log_path: Path,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
) -> Server:
    """``python -m pagedllm serve ARGS``, the user's command, with ``env`` added to the environment."""
    port = _free_port()
    command = [sys.executable, "-m", "pagedllm", "serve", *args]
    command += ["--port", str(port), "--stats-interval", "0", "--no-access-log"]
    env = {**os.environ, **(env or {})}
    if api_key:
        env["PAGEDLLM_API_KEY"] = api_key
    with open(log_path, "wb") as log:
        # The log goes to a file: a pipe nobody reads would fill up and block the server.
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(process, port, log_path, api_key)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            if server.request("GET", "/health")[0] == 200:
                return server
        except OSError:
            pass  # not listening yet
        # A refused connection costs nothing: polling often ends the wait soon after /health answers.
        time.sleep(0.05)
    server.stop()
    pytest.fail(f"the server did not answer /health in {STARTUP_TIMEOUT_S} s:\n{server.log_tail()}")


@pytest.fixture(scope="module")
def launch_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Server]]:
    """launch(args, api_key=None, env=None) -> Server; every server launched is stopped after the
    module."""
    servers: list[Server] = []

    def launch(args: list[str], api_key: str | None = None, **kwargs: Any) -> Server:
        log_path = tmp_path_factory.mktemp("server") / "server.log"
        servers.append(start_server(args, log_path, api_key, **kwargs))
        return servers[-1]

    yield launch
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama (no tokenizer: prompts are token ids) saved once per module."""
    config = LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * TINY_MAX_MODEL_LEN,
    )
    torch.manual_seed(0)
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    return str(model_dir)


@pytest.fixture(scope="module")
def tiny_server_args(tiny_model_dir: str) -> list[str]:
    """Flags that serve the tiny model with room for W4's lengths and a small KV cache."""
    return [
        tiny_model_dir,
        "--max-model-len",
        str(TINY_MAX_MODEL_LEN),
        "--num-kv-blocks",
        "2048",
        # Allocating the default 4 GiB of swap space takes seconds.
        "--swap-space",
        "0.1",
    ]


@pytest.fixture(scope="module")
def tiny_vocab_size() -> int:
    return TINY_VOCAB_SIZE


# --- one server for the API-surface tests (chat parsers, /v1/responses, /v1/messages) ----------

SURFACE_API_KEY = "surface-key"
# A chat template with a thinking section (Qwen3's shape) that takes tools, tool calls and
# reasoning_effort.
THINKING_TEMPLATE = (
    "{% if tools %}TOOLS: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if reasoning_effort %}Reasoning effort: {{ reasoning_effort }}\n{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="session")
def surface_server(tiny_llama_with_tokenizer, tmp_path_factory) -> Iterator[Server]:
    """The tiny Llama with SmolLM2's tokenizer and THINKING_TEMPLATE, served with the qwen3
    reasoning parser, hermes tool calls and an API key; shared by the test modules of the API
    surface (one start instead of one per module)."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("thinking-model")
    shutil.copytree(tiny_llama_with_tokenizer, path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_with_tokenizer)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(path)
    args = [str(path), "--max-model-len", "256", "--swap-space", "0.1", "--served-model-name", "tiny"]
    args += ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    args += ["--trust-request-chat-template"]
    server = start_server(args, tmp_path_factory.mktemp("surface") / "server.log", SURFACE_API_KEY)
    yield server
    server.stop()
