"""``pagedllm bench serve``: the online-serving workload W4 against an OpenAI-compatible server.

W4 (shared benchmarks/README.md): with ``random.seed(0)``, 500 prompts of random token ids
(``[random.randint(0, 10000) for _ in range(random.randint(100, 1024))]``), then 500 output
lengths uniform in [32, 512], drawn after the prompts. Each prompt goes to /v1/completions as
token ids, streamed, with ``max_tokens`` = its output length, ``ignore_eos`` and temperature 0.
Requests start at Poisson arrivals of the given rate; for each rate the run reports request and
output token throughput, time to first token (TTFT), time per output token after the first
(TPOT, per request) and inter-chunk latency (ITL) at p50/p90/p99, and the failures; it writes a
JSON file and a PNG of latency against rate.

Any server that speaks the OpenAI API and vLLM's ``ignore_eos`` works, pagedllm's or another.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import sys
import time
from typing import Any

import numpy as np

W4_NUM_PROMPTS = 500
W4_SEED = 0
PERCENTILES = (50, 90, 99)
# Each summary's first error messages, so that a failing run says why.
MAX_ERRORS_KEPT = 5


@dataclasses.dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclasses.dataclass
class RequestResult:
    prompt_len: int
    output_len: int
    success: bool = False
    error: str | None = None
    # Output tokens the server reported (usage.completion_tokens).
    num_output_tokens: int = 0
    ttft: float | None = None
    latency: float | None = None
    # Seconds between consecutive chunks after the first.
    itls: list[float] = dataclasses.field(default_factory=list)
    # When it was sent, in seconds from the run's start.
    start: float = 0.0


def w4_requests(
    num_prompts: int = W4_NUM_PROMPTS,
    vocab_size: int | None = None,
    input_len: int | None = None,
    output_len: int | None = None,
) -> list[BenchRequest]:
    """The first ``num_prompts`` requests of W4.

    Args:
        num_prompts: at most 500; fewer takes a prefix of the same workload.
        vocab_size: when the served model's vocabulary is smaller than W4's ids (tiny test models),
            each id is folded into it (id % vocab_size), keeping the ids varied.
        input_len, output_len: every prompt, or every output, exactly this long instead of W4's
            uniform draws (vLLM's ``--random-input-len`` and ``--random-output-len``); the token ids
            are still drawn from W4's seeded stream, and any number of prompts may be asked.
    """
    custom = input_len is not None or output_len is not None
    if num_prompts < 1 or (num_prompts > W4_NUM_PROMPTS and not custom):
        raise ValueError(f"num_prompts must be in [1, {W4_NUM_PROMPTS}] for W4's lengths, got {num_prompts}")
    for name, value in (("random_input_len", input_len), ("random_output_len", output_len)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    num_drawn = max(num_prompts, W4_NUM_PROMPTS)
    rng = random.Random(W4_SEED)  # the same stream as random.seed(0) and the module functions
    prompts = [
        [rng.randint(0, 10000) for _ in range(input_len or rng.randint(100, 1024))] for _ in range(num_drawn)
    ]
    output_lens = [output_len or rng.randint(32, 512) for _ in range(num_drawn)]
    if vocab_size is not None:
        prompts = [[token_id % vocab_size for token_id in prompt] for prompt in prompts]
    return [BenchRequest(p, n) for p, n in zip(prompts[:num_prompts], output_lens[:num_prompts])]


async def send_request(
    session: Any, url: str, model: str, request: BenchRequest, headers: dict[str, str], sent_at: float = 0.0
) -> RequestResult:
    """Send one streamed completion (``sent_at`` seconds into the run); time its chunks."""
    import aiohttp

    result = RequestResult(len(request.prompt_token_ids), request.output_len, start=sent_at)
    payload = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                return result
            async for raw_line in response.content:
                line = raw_line.strip()
                if not line.startswith(b"data: "):
                    continue  # the blank line between events
                data = line[len(b"data: ") :]
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk["error"]))
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    result.success = result.ttft is not None
    if not result.success:
        result.error = "the stream ended without output"
    return result


async def run_at_rate(
    url: str,
    model: str,
    requests: list[BenchRequest],
    request_rate: float,
    headers: dict[str, str],
    timeout_s: float,
    max_concurrency: int | None = None,
    show_progress: bool = False,
) -> tuple[list[RequestResult], float]:
    """Send every request, starting them at Poisson arrivals of ``request_rate`` per second (all at
    once when infinite), at most ``max_concurrency`` in flight (None: no bound; an arrival beyond
    it waits, and its times start when it is sent, as vLLM's benchmark does). Returns the results
    and the run's duration in seconds; ``show_progress``: a bar of requests done on stderr."""
    import aiohttp
    from tqdm.auto import tqdm

    # Seeded: every run, and every server compared, sees the same arrival times.
    arrivals = random.Random(W4_SEED)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # No connection limit: a client-side queue would add its wait to the server's TTFT.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    progress = tqdm(
        total=len(requests),
        desc=f"rate {request_rate:g}/s",
        unit="req",
        file=sys.stderr,
        disable=not show_progress,
    )

    async def send(request: BenchRequest) -> RequestResult:
        if slots is None:
            return await send_request(session, url, model, request, headers, time.perf_counter() - start)
        async with slots:
            return await send_request(session, url, model, request, headers, time.perf_counter() - start)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.ensure_future(send(request)))
            tasks[-1].add_done_callback(lambda _: progress.update())
            if math.isfinite(request_rate):
                await asyncio.sleep(arrivals.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        progress.close()
        return list(results), time.perf_counter() - start


def _distribution_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    array = np.asarray(values) * 1000.0
    return {"mean": float(array.mean()), **{f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}}


def summarize(request_rate: float, results: list[RequestResult], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.success]
    tpots = [
        (r.latency - r.ttft) / (r.num_output_tokens - 1)
        for r in done
        if r.latency is not None and r.ttft is not None and r.num_output_tokens > 1
    ]
    num_output_tokens = sum(r.num_output_tokens for r in done)
    return {
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        # Completed with fewer tokens than asked: lost work all the same.
        "incomplete": sum(r.num_output_tokens != r.output_len for r in done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": num_output_tokens / duration,
        "total_token_throughput": (num_output_tokens + sum(r.prompt_len for r in done)) / duration,
        "ttft_ms": _distribution_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": _distribution_ms(tpots),
        "itl_ms": _distribution_ms([itl for r in done for itl in r.itls]),
        "errors": [r.error for r in results if r.error][:MAX_ERRORS_KEPT],
        # Each request in the order sent, to see when the slow ones came: [sent at (s), prompt
        # tokens, TTFT (ms), latency (s)].
        "requests": [
            [
                round(r.start, 4),
                r.prompt_len,
                _round_ms(r.ttft),
                None if r.latency is None else round(r.latency, 3),
            ]
            for r in results
        ],
    }


def _round_ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 2)


def format_summary(summary: dict[str, Any]) -> str:
    def row(name: str, key: str) -> str:
        values = summary[key]
        cells = [values["mean"], *(values[f"p{p}"] for p in PERCENTILES)]
        return f"  {name:<5}" + "".join("         -" if v is None else f"{v:10.1f}" for v in cells)

    lines = [
        f"request rate {summary['request_rate']} req/s: {summary['completed']}/{summary['num_requests']} "
        f"completed, {summary['failed']} failed, {summary['incomplete']} incomplete, "
        f"{summary['duration_s']:.1f} s",
        f"  {summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s, "
        f"{summary['total_token_throughput']:.1f} total tok/s",
        "  (ms)       mean" + "".join(f"{'p' + str(p):>10}" for p in PERCENTILES),
        row("TTFT", "ttft_ms"),
        row("TPOT", "tpot_ms"),
        row("ITL", "itl_ms"),
    ]
    lines += [f"  error: {error}" for error in summary["errors"]]
    return "\n".join(lines)


def plot(summaries: list[dict[str, Any]], path: str) -> bool:
    """Latency percentiles against request rate (finite rates only); False when matplotlib is
    missing or no finite rate was run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    finite = sorted((s for s in summaries if s["request_rate"] != "inf"), key=lambda s: s["request_rate"])
    if not finite:
        print("no finite request rate was run: no plot", file=sys.stderr)
        return False
    rates = [s["request_rate"] for s in finite]
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, title) in zip(axes, (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"))):
        for p in PERCENTILES:
            values = [s[key][f"p{p}"] for s in finite]
            ax.plot(rates, [math.nan if v is None else v for v in values], marker="o", label=f"p{p}")
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
        ax.legend()
    figure.suptitle(f"W4 online serving: {finite[0]['num_requests']} requests per rate")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


async def _served_model(base_url: str, headers: dict[str, str]) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(f"{base_url}/v1/models", headers=headers) as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


async def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or await _served_model(base_url, headers)
    requests = w4_requests(args.num_prompts, args.vocab_size, args.random_input_len, args.random_output_len)
    summaries = []
    for rate in args.request_rate:
        results, duration = await run_at_rate(
            f"{base_url}/v1/completions",
            model,
            requests,
            rate,
            headers,
            args.timeout,
            args.max_concurrency,
            show_progress=args.progress,
        )
        summaries.append(summarize(rate, results, duration))
        print(format_summary(summaries[-1]), flush=True)
    return summaries


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument(
        "--api-key", default=None, help="bearer token (default: $PAGEDLLM_API_KEY or $OPENAI_API_KEY)"
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[8.0, 16.0, 32.0, 64.0],
        help="requests per second, Poisson arrivals; several run one after another; inf: all at once",
    )
    parser.add_argument("--num-prompts", type=int, default=W4_NUM_PROMPTS, help="the first N requests of W4")
    parser.add_argument(
        "--random-input-len",
        type=int,
        default=None,
        help="every prompt this many tokens (default: W4's, uniform in [100, 1024])",
    )
    parser.add_argument(
        "--random-output-len",
        type=int,
        default=None,
        help="every output this many tokens (default: W4's, uniform in [32, 512])",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight; later arrivals wait to be sent (default: no bound)",
    )
    parser.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="a progress bar on stderr"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="fold prompt token ids into a smaller vocabulary"
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one request may take")
    parser.add_argument("--result-file", default="bench_serve.json", help="JSON results")
    parser.add_argument("--plot-file", default="bench_serve.png", help="PNG of latency against rate")
    return parser


def main(args: argparse.Namespace) -> None:
    """Run W4 at each rate, print a summary per rate, write the JSON results and the plot."""
    if args.api_key is None:
        args.api_key = os.environ.get("PAGEDLLM_API_KEY") or os.environ.get("OPENAI_API_KEY")
    summaries = asyncio.run(_run(args))
    with open(args.result_file, "w") as f:
        json.dump(
            {
                "workload": "W4",
                "base_url": args.base_url,
                "num_prompts": args.num_prompts,
                "vocab_size": args.vocab_size,
                "random_input_len": args.random_input_len,
                "random_output_len": args.random_output_len,
                "max_concurrency": args.max_concurrency,
                "results": summaries,
            },
            f,
            indent=2,
        )
    print(f"results: {args.result_file}")
    if plot(summaries, args.plot_file):
        print(f"plot: {args.plot_file}")


if __name__ == "__main__":
    main(add_cli_args(argparse.ArgumentParser(prog="pagedllm bench serve")).parse_args())
