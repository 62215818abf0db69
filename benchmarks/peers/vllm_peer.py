"""vLLM beside pagedllm on the GPU workloads, alternating, in one call.

    python benchmarks/peers/vllm_peer.py --workloads W1 W3 W4 [--repeats 2] [--vllm-site /tmp/vllm-site]
        [--output-json benchmarks/results/vllm_peer.json] [--output-png vllm_peer.png]
    python benchmarks/peers/vllm_peer.py --merge A.json B.json --output-json AB.json --output-png AB.png

W1, W2, W5 (offline throughput) and W3 (one request's latency) go through each engine's offline
``LLM`` (vLLM's names on both sides): dummy weights of the same HF config (benchmarks/configs/),
the prompt token ids of pagedllm/entrypoints/bench/workloads.py as TokensPrompts, greedy
``SamplingParams(temperature=0, ignore_eos=True, max_tokens=...)``, and the same
gpu_memory_utilization, max_num_seqs, max_num_batched_tokens and max_model_len; everything else is
each engine's default (CUDA graphs, async scheduling, its attention backend). Both engines get
``skip_tokenizer_init=True``: the config directories hold no tokenizer and the prompts are ids.
Each run is a subprocess of its own, so one engine's GPU memory is gone before the other starts;
the order alternates between repeats. W4 starts ``pagedllm serve`` and ``vllm serve`` in turn
(same flags as scripts/serve_bench.sh) and drives each with ``pagedllm bench serve`` at the same
rates.

vLLM comes from ``--vllm-site`` (a ``pip install --target`` directory, scripts/install_peer.sh),
prepended to PYTHONPATH for its subprocesses only; or from ``--vllm-python``, a virtualenv of its
own (``pip install vllm==0.26.0`` where there is a network); or from the running Python.
A missing or failing peer is said in one line per workload; pagedllm's side still runs, and the
table and JSON mark the peer's cell as not measured.

Figures: W1/W2/W5 output tok/s = output tokens / wall time of one ``generate`` over every prompt
(after a warm-up ``generate`` of 64 prompts x 16 tokens); W3 ms/token = (median wall time of a
256-token request - median of a 1-token request) / 255, the first token's time = the 1-token
request's. Ratios are pagedllm / vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ENGINES = ("pagedllm", "vllm")
RESULT_MARK = "PEER_RESULT "  # the child's result line; engines also log to stdout
OFFLINE = ("W1", "W2", "W3", "W5")
# Issue 34's bars for pagedllm / vLLM: tok/s at least 1.1x, W3's ms/token and W4's p99s at most.
TARGETS = {"W1": ">= 1.1", "W2": ">= 1.1", "W5": ">= 1.1", "W3": "<= 0.9", "W4": "<= 1.0"}
W3_ITERS = 3


@dataclasses.dataclass(frozen=True)
class Settings:
    """What both engines are given; every other engine argument stays at its default."""

    model: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float = 0.9

    def llm_kwargs(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "load_format": "dummy",
            "dtype": "bfloat16",
            "seed": 0,
            "enable_chunked_prefill": True,  # vLLM's v1 scheduler always chunks; pagedllm's is opt-in
            "skip_tokenizer_init": True,
        }

    def serve_flags(self, engine: str) -> list[str]:
        # pagedllm's server finds no tokenizer in the directory and serves token ids; vLLM's must
        # be told to skip it.
        skip_tokenizer = ["--skip-tokenizer-init"] if engine == "vllm" else []
        return [
            self.model,
            "--load-format", "dummy",
            "--dtype", "bfloat16",
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
            "--enable-chunked-prefill",
            *skip_tokenizer,
        ]  # fmt: skip


def workload_settings(name: str, model: str | None = None) -> Settings:
    """The settings pagedllm's own benchmarks use for ``name`` (throughput.py, latency.py,
    serve_bench.sh), written out so that vLLM gets them too; ``model`` replaces the config dir."""
    from pagedllm.entrypoints.bench.throughput import OFFLINE_MAX_NUM_BATCHED_TOKENS
    from pagedllm.entrypoints.bench.workloads import CONFIG_DIR, WORKLOADS

    if name == "W4":
        return Settings(model or os.path.normpath(os.path.join(CONFIG_DIR, "qwen3-0.6b")), 1536, 256, 4096)
    workload = WORKLOADS[name]
    model = model or workload.model
    if name == "W3":
        # One request either way; 8 sequences, not 1: vLLM 0.26.0's CUDA-graph capture at sizes
        # [1, 2] (max_num_seqs=1) hit an illegal memory access on an H100 (2026-11-27).
        return Settings(model, workload.max_model_len, 8, 2048)
    return Settings(model, workload.max_model_len, 256, OFFLINE_MAX_NUM_BATCHED_TOKENS)


# --- one engine, one workload: the child process -------------------------------------------------


def _engine_api(engine: str) -> tuple[Any, Any, str]:
    """(LLM, SamplingParams, version) of ``engine``."""
    if engine == "vllm":
        import vllm
        from vllm import LLM, SamplingParams

        return LLM, SamplingParams, vllm.__version__
    import pagedllm
    from pagedllm import LLM, SamplingParams

    return LLM, SamplingParams, pagedllm.__version__


def _timed_generate(llm: Any, prompts: list[list[int]], params: Any) -> tuple[float, int]:
    """(seconds, output tokens) of one ``generate`` over ``prompts``."""
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def measure_offline(llm: Any, sampling_params: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """W1/W2/W5: output tok/s of every prompt at once; W3: one request's per-token latency."""
    prompts, output_len = spec["prompts"], spec["output_len"]

    def params(max_tokens: int) -> Any:
        return sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    if spec["workload"] == "W3":
        _timed_generate(llm, prompts, params(8))  # warm-up
        firsts = [_timed_generate(llm, prompts, params(1)) for _ in range(W3_ITERS)]
        fulls = [_timed_generate(llm, prompts, params(output_len)) for _ in range(W3_ITERS)]
        _check_tokens([n for _, n in fulls], output_len)
        first, full = statistics.median(t for t, _ in firsts), statistics.median(t for t, _ in fulls)
        return {"ms_per_token": 1e3 * (full - first) / (output_len - 1), "first_token_ms": 1e3 * first}
    _timed_generate(llm, prompts[:64], params(16))  # warm-up: kernels, graphs, the cache touched
    elapsed, num_output = _timed_generate(llm, prompts, params(output_len))
    _check_tokens([num_output], len(prompts) * output_len)
    return {"output_tok_s": num_output / elapsed, "elapsed_s": elapsed, "output_tokens": num_output}


def _check_tokens(counts: list[int], expected: int) -> None:
    # Fewer tokens: ignore_eos not honoured, or requests lost; the run would not be comparable.
    if any(n != expected for n in counts):
        raise RuntimeError(f"{counts} output tokens, expected {expected} each time")


def child(engine: str, spec_path: str) -> None:
    """Run one offline workload on ``engine``; print its result as the RESULT_MARK line."""
    spec = json.loads(Path(spec_path).read_text())
    llm_class, sampling_params, version = _engine_api(engine)
    llm = llm_class(**spec["settings"])
    result = measure_offline(llm, sampling_params, spec)
    result.update(engine=engine, version=version, device=_device())
    print(RESULT_MARK + json.dumps(result), flush=True)


# --- the sitting: engines alternated in subprocesses ----------------------------------------------


def engine_python(engine: str, vllm_python: str | None) -> str:
    """The interpreter of ``engine``'s processes: vLLM's own virtualenv where one is given."""
    return vllm_python if engine == "vllm" and vllm_python else sys.executable


def engine_env(engine: str, vllm_site: str | None) -> dict[str, str]:
    """The environment of ``engine``'s processes: vLLM's site directory first for vLLM alone."""
    paths = [str(REPO)] + ([vllm_site] if engine == "vllm" and vllm_site else [])
    paths.reverse()  # the site directory shadows the image's copies of what it holds
    existing = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([existing] if existing else []))}


def peer_version(vllm_site: str | None, vllm_python: str | None = None) -> tuple[str | None, str | None]:
    """(vLLM's version, None) when ``import vllm`` works for its processes, else (None, why: one
    line)."""
    if vllm_site and not os.path.isdir(os.path.join(vllm_site, "vllm")):
        return None, f"no vllm in {vllm_site} (scripts/install_peer.sh installs it there)"
    if vllm_python and not os.access(vllm_python, os.X_OK):
        return None, f"no Python at {vllm_python}"
    check = subprocess.run(
        [engine_python("vllm", vllm_python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True, text=True, env=engine_env("vllm", vllm_site), timeout=300,
    )  # fmt: skip
    if check.returncode != 0:
        return None, f"import vllm failed: {last_line(check.stderr)}"
    return last_line(check.stdout), None


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def run_child(engine: str, spec: dict[str, Any], args: argparse.Namespace, log_path: Path) -> dict[str, Any]:
    """One offline run in a subprocess (its output kept in ``log_path``): its result, or
    {"error": one line}."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    cmd = [engine_python(engine, args.vllm_python), __file__, "--child", engine, "--child-spec", f.name]
    # A session of its own: a timeout ends the engine's own subprocesses too (vLLM's engine core),
    # which would otherwise keep their GPU memory from the next run.
    process = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=engine_env(engine, args.vllm_site), start_new_session=True,
    )  # fmt: skip
    timed_out = False
    try:
        stdout, stderr = process.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        stop_group(process)
        stdout, stderr = process.communicate()
    finally:
        os.unlink(f.name)
    stop_group(process)
    log_path.write_text(stdout + stderr)
    results = [line for line in stdout.splitlines() if line.startswith(RESULT_MARK)]
    if results:  # a run whose engine then hung in its shutdown still measured
        return json.loads(results[-1][len(RESULT_MARK) :])
    if timed_out:
        return {"error": f"no result within {args.timeout:.0f} s (log: {log_path})"}
    return {"error": f"exit {process.returncode}: {last_line(stderr or stdout)} (log: {log_path})"}


def stop_group(process: subprocess.Popen) -> None:
    """End ``process`` and every process of its session: SIGTERM, then SIGKILL whatever is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def offline_spec(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """What each engine's child runs: the same prompt ids, lengths and settings for both."""
    from pagedllm.entrypoints.bench.workloads import WORKLOADS

    workload = WORKLOADS[name]
    return {
        "workload": name,
        "prompts": workload.prompts(args.num_prompts),
        "output_len": args.output_len or workload.output_len,
        "settings": workload_settings(name, args.model).llm_kwargs(),
    }


def engine_order(repeat: int, engines: list[str]) -> list[str]:
    """Alternate which engine goes first, so drift in the machine hits both alike."""
    return engines if repeat % 2 == 0 else engines[::-1]


def run_offline(
    name: str, engines: list[str], args: argparse.Namespace, problems: dict[str, str], out_dir: Path
) -> dict[str, list[dict[str, Any]]]:
    spec = offline_spec(name, args)
    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    for repeat in range(args.repeats):
        for engine in engine_order(repeat, engines):
            if engine in problems:
                continue
            result = run_child(engine, spec, args, out_dir / f"{name.lower()}_{engine}_{repeat}.log")
            if "error" in result:
                print(f"{name}: {engine} failed: {result['error']}", flush=True)
            runs[engine].append(result)
    return runs


# --- W4: a server per engine ------------------------------------------------------------------------


def server_command(engine: str, settings: Settings, port: int, vllm_python: str | None = None) -> list[str]:
    module = "pagedllm" if engine == "pagedllm" else "vllm.entrypoints.cli.main"
    python = engine_python(engine, vllm_python)
    return [python, "-m", module, "serve", *settings.serve_flags(engine), "--port", str(port)]


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float) -> str | None:
    """None once ``url``/health answers 200; else why not (one line)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"server exited with {process.returncode}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return None
        except OSError:
            pass
        time.sleep(2)
    return f"server not healthy within {timeout_s:.0f} s"


def run_serve(engine: str, args: argparse.Namespace, out_dir: Path, repeat: int) -> dict[str, Any]:
    """Start ``engine``'s server, run ``pagedllm bench serve`` against it, stop it."""
    settings = workload_settings("W4", args.model)
    port = args.port + repeat * len(ENGINES) + ENGINES.index(engine)
    url = f"http://127.0.0.1:{port}"
    log_path = out_dir / f"w4_{engine}_{repeat}_server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            server_command(engine, settings, port, args.vllm_python), stdout=log, stderr=subprocess.STDOUT,
            env=engine_env(engine, args.vllm_site), start_new_session=True,
        )  # fmt: skip
    try:
        problem = wait_healthy(url, server, args.timeout)
        if problem:
            return {"error": f"{problem}: {last_line(log_path.read_text())}"}
        result_file = out_dir / f"w4_{engine}_{repeat}.json"
        client = [
            sys.executable, "-m", "pagedllm", "bench", "serve", "--base-url", url,
            "--request-rate", *[str(r) for r in args.request_rates],
            *(["--num-prompts", str(args.num_prompts)] if args.num_prompts else []),
            "--result-file", str(result_file), "--plot-file", str(out_dir / f"w4_{engine}_{repeat}.png"),
        ]  # fmt: skip
        done = subprocess.run(client, capture_output=True, text=True, env=engine_env("pagedllm", None))
        if done.returncode != 0:
            return {"error": f"bench serve exit {done.returncode}: {last_line(done.stderr)}"}
        summaries = json.loads(result_file.read_text())["results"]
        return {"engine": engine, "rates": [_serve_figures(s) for s in summaries]}
    finally:
        stop_group(server)


def _serve_figures(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "request_rate": summary["request_rate"],
        "p99_ttft_ms": summary["ttft_ms"]["p99"],
        "p99_tpot_ms": summary["tpot_ms"]["p99"],
        "output_tok_s": summary["output_throughput"],
        "lost": summary["failed"] + summary["incomplete"],
    }


def run_w4(
    engines: list[str], args: argparse.Namespace, problems: dict[str, str], out_dir: Path
) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    for repeat in range(args.repeats):
        for engine in engine_order(repeat, engines):
            if engine in problems:
                continue
            result = run_serve(engine, args, out_dir, repeat)
            if "error" in result:
                print(f"W4: {engine} failed: {result['error']}", flush=True)
            runs[engine].append(result)
    return runs


# --- the table ------------------------------------------------------------------------------------------


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def _cell(value: float | None, why: str | None, digits: int = 1) -> str:
    if value is not None:
        return f"{value:,.{digits}f}"
    return f"not measured ({why})" if why else "not measured"


def _why(engine: str, runs: list[dict[str, Any]], problems: dict[str, str]) -> str | None:
    if engine in problems:
        return problems[engine]
    errors = [r["error"] for r in runs if "error" in r]
    return errors[0] if errors else None


def table_rows(result: dict[str, Any]) -> list[str]:
    """Markdown rows: workload, figure, pagedllm, vLLM, ratio, target."""
    problems = result["problems"]
    rows = []
    for name, runs in result["workloads"].items():
        if name == "W4":
            rows += _w4_rows(runs, problems)
            continue
        key, label = ("ms_per_token", "ms/token") if name == "W3" else ("output_tok_s", "output tok/s")
        mine, peer = _median(runs["pagedllm"], key), _median(runs.get("vllm", []), key)
        ratio = f"{mine / peer:.2f}x" if mine and peer else "-"
        rows.append(
            f"| {name} | {label} | {_cell(mine, _why('pagedllm', runs['pagedllm'], problems), 2)} | "
            f"{_cell(peer, _why('vllm', runs.get('vllm', []), problems), 2)} | {ratio} | {TARGETS[name]} |"
        )
    return rows


def _w4_rows(runs: dict[str, list[dict[str, Any]]], problems: dict[str, str]) -> list[str]:
    def by_rate(engine: str) -> dict[Any, list[dict[str, Any]]]:
        rates: dict[Any, list[dict[str, Any]]] = {}
        for run in runs.get(engine, []):
            for figures in run.get("rates", []):
                rates.setdefault(figures["request_rate"], []).append(figures)
        return rates

    mine, peer = by_rate("pagedllm"), by_rate("vllm")
    why_a, why_b = _why("pagedllm", runs["pagedllm"], problems), _why("vllm", runs.get("vllm", []), problems)
    rows = []
    for rate in sorted(set(mine) | set(peer), key=str):
        for key, label in (("p99_ttft_ms", "p99 TTFT ms"), ("p99_tpot_ms", "p99 TPOT ms"), ("lost", "lost")):
            a, b = _median(mine.get(rate, []), key), _median(peer.get(rate, []), key)
            ratio = f"{a / b:.2f}x" if a is not None and b and key != "lost" else "-"
            target = TARGETS["W4"] if key != "lost" else "0"
            cells = f"{_cell(a, why_a)} | {_cell(b, why_b)}"
            rows.append(f"| W4 @{rate}/s | {label} | {cells} | {ratio} | {target} |")
    if not rows:
        rows.append(f"| W4 | - | not measured ({why_a or why_b}) | | - | |")
    return rows


def table(result: dict[str, Any]) -> str:
    versions = result["versions"]
    head = [
        f"pagedllm {versions.get('pagedllm', '?')} against vLLM {versions.get('vllm', 'not run')} "
        f"on {result['device']}, {result['date']}, {result['repeats']} run(s) each, medians",
        "",
        "| workload | figure | pagedllm | vLLM | pagedllm / vLLM | target |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    return "\n".join(head + table_rows(result))


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several sittings as one (the workloads of one warm machine's calls): every run kept, the
    first sitting's date and device; sittings on different devices are refused, since their
    figures do not compare."""
    devices = {r["device"] for r in results}
    if len(devices) > 1:
        raise ValueError(f"sittings on different devices do not merge: {sorted(devices)}")
    merged: dict[str, Any] = {
        **results[0],
        "command": [r["command"] for r in results],
        "repeats": max(r["repeats"] for r in results),
        "problems": {},
        "versions": {},
        "workloads": {},
    }
    for result in results:
        merged["problems"].update(result["problems"])
        merged["versions"].update(result["versions"])
        for name, runs in result["workloads"].items():
            for engine, engine_runs in runs.items():
                merged["workloads"].setdefault(name, {}).setdefault(engine, []).extend(engine_runs)
    return merged


def plot(result: dict[str, Any], path: str) -> bool:
    """One panel per offline workload: the two engines' medians side by side, in the workload's
    unit (W3: ms/token, lower is better); an engine not measured is an empty slot labelled so."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    names = [name for name in result["workloads"] if name in OFFLINE]
    if not names:
        return False
    figure, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.6), squeeze=False)
    for axis, name in zip(axes[0], names):
        runs = result["workloads"][name]
        if name == "W3":
            key, label = "ms_per_token", "ms/token (lower is better)"
        else:
            key, label = "output_tok_s", "output tok/s"
        values = [_median(runs.get(engine, []), key) for engine in ENGINES]
        bars = axis.bar(ENGINES, [v or 0.0 for v in values], color=["tab:blue", "tab:gray"])
        for bar, value in zip(bars, values):
            text = "not measured" if value is None else f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
            top = (bar.get_x() + bar.get_width() / 2, bar.get_height())
            axis.annotate(text, top, ha="center", va="bottom")
        axis.set_title(name)
        axis.set_ylabel(label)
    versions = result["versions"]
    figure.suptitle(
        f"pagedllm {versions.get('pagedllm', '?')} and vLLM {versions.get('vllm', 'not run')} on "
        f"{result['device']}, {result['date']}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def _device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    except ImportError:
        return "unknown device"


def sitting(args: argparse.Namespace) -> dict[str, Any]:
    import pagedllm

    engines = list(args.engines)
    problems: dict[str, str] = {}
    versions = {"pagedllm": pagedllm.__version__}
    if "vllm" in engines:
        version, problem = peer_version(args.vllm_site, args.vllm_python)
        if problem:
            problems["vllm"] = problem
            print(f"vLLM peer unavailable, running pagedllm only: {problem}", flush=True)
        else:
            versions["vllm"] = version
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workloads: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name in args.workloads:
        print(f"=== {name}", flush=True)
        if name == "W4":
            workloads[name] = run_w4(engines, args, problems, out_dir)
        else:
            workloads[name] = run_offline(name, engines, args, problems, out_dir)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": _device(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "repeats": args.repeats,
        "problems": problems,
        "versions": versions,
        "workloads": workloads,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=[*OFFLINE, "W4"], default=["W1", "W3"])
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--repeats", type=int, default=1, help="runs per engine and workload, alternating")
    parser.add_argument("--num-prompts", type=int, default=None, help="the workload's first N prompts")
    parser.add_argument("--output-len", type=int, default=None, help="instead of the workload's (smoke runs)")
    parser.add_argument("--model", default=None, help="instead of the workload's config directory")
    parser.add_argument("--vllm-site", default=None, help="a pip --target directory holding vllm")
    parser.add_argument("--vllm-python", default=None, help="the python of a virtualenv with vllm")
    parser.add_argument("--request-rates", nargs="+", type=float, default=[32.0], help="W4's rates")
    parser.add_argument("--port", type=int, default=18100, help="W4: the first server's port")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds one run (or start) may take")
    parser.add_argument("--out-dir", default="/tmp/vllm_peer", help="each run's log; W4's results, plots")
    parser.add_argument("--output-json", default=str(REPO / "benchmarks" / "results" / "vllm_peer.json"))
    parser.add_argument("--output-png", default=None, help="the offline workloads' plot")
    parser.add_argument(
        "--merge", nargs="+", default=None, metavar="JSON",
        help="run nothing: merge these sittings' results (one machine's calls), print and write them",
    )  # fmt: skip
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--child-spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    for flag, value, least in (("--num-prompts", args.num_prompts, 1), ("--output-len", args.output_len, 2)):
        if value is not None and value < least:
            parser.error(f"{flag} must be at least {least}, got {value}")
    if "pagedllm" not in args.engines:
        parser.error("--engines must include pagedllm: the peer is measured beside it")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if args.child:
        child(args.child, args.child_spec)
        return None
    if args.merge:
        result = merge([json.loads(Path(path).read_text()) for path in args.merge])
    else:
        result = sitting(args)
    print(table(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    if args.output_png:
        plot(result, args.output_png)
    return result


if __name__ == "__main__":
    main()
