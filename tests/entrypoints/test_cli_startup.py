"""The ``pagedllm`` command's start-up: a parser built without torch, --version, --log-level on
every command, defaults in --help, the engine summary, and the notice that a native build starts."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import pagedllm
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import BENCHMARKS, HelpFormatter, build_parser, main
from pagedllm.entrypoints.utils import engine_summary
from pagedllm.kernels.cpu import build

# Every command that runs something, as its argv prefix.
COMMANDS = [["generate"], ["chat"], ["serve"], *(["bench", name] for name in BENCHMARKS)]
HEAVY_MODULES = ("torch", "transformers", "pagedllm.engine.llm_engine")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )


def test_building_the_parsers_imports_neither_torch_nor_the_engine():
    # A fresh interpreter: this one imported torch long ago.
    code = f"""
import json, sys
import pagedllm
from pagedllm.entrypoints.cli import build_parser
for argv in (["--help"], ["generate", "--help"], ["chat"], ["serve"], ["bench", "serve"]):
    build_parser(argv)
print(json.dumps([m for m in {list(HEAVY_MODULES)!r} + ["pagedllm.entrypoints.bench.throughput"]
                  if m in sys.modules]))
"""
    assert json.loads(_python(code).stdout) == []


def test_the_package_names_its_api_and_imports_it_on_first_use():
    code = f"""
import json, sys
import pagedllm
before = [m for m in {list(HEAVY_MODULES)!r} if m in sys.modules]
from pagedllm import LLM, SamplingParams
print(json.dumps([before, LLM.__module__, SamplingParams.__name__, sorted(pagedllm.__all__)]))
"""
    before, llm_module, sampling_params, names = json.loads(_python(code).stdout)
    assert before == []
    assert llm_module == "pagedllm.entrypoints.llm" and sampling_params == "SamplingParams"
    assert set(names) <= set(dir(pagedllm))
    with pytest.raises(AttributeError, match="no attribute 'nowhere'"):
        pagedllm.nowhere  # noqa: B018


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"pagedllm {pagedllm.__version__}"


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_takes_a_log_level(command: list[str]):
    parser = build_parser(command)
    assert parser.parse_args(command).log_level == "info"
    assert parser.parse_args([*command, "--log-level", "debug"]).log_level == "debug"
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--log-level", "loud"])


def test_only_the_benchmark_asked_for_gets_its_flags():
    args = build_parser(["bench", "serve"]).parse_args(["bench", "serve", "--request-rate", "2"])
    assert args.func.__module__ == "pagedllm.entrypoints.bench.serve"
    assert build_parser(["generate"]).parse_args(["generate", "hi"]).prompts == ["hi"]


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _subparsers(sub)
    return found


def test_help_tells_every_default():
    formatter = HelpFormatter("pagedllm")
    missing = []
    for parser in _subparsers(build_parser()):
        for action in parser._actions:
            if not action.option_strings or action.default in (None, argparse.SUPPRESS):
                continue
            is_switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
            if not is_switch and "default" not in (formatter._get_help_string(action) or ""):
                missing.append(f"{parser.prog} {action.option_strings[0]}")
    assert missing == []
    generate_help = build_parser(["generate"])._subparsers._group_actions[0].choices["generate"]
    assert "(default: 16)" in " ".join(generate_help.format_help().split())


def test_the_engine_summary_names_what_runs_and_the_kv_cache():
    config = EngineArgs(load_format="dummy", device="cpu", threads=2).create_engine_config()
    summary = engine_summary(config, num_gpu_blocks=100, load_seconds=1.5)
    dtype = str(config.model_config.dtype).removeprefix("torch.")
    assert summary.startswith("engine ready in 1.5 s: model SmolLM2-135M-Instruct.Q4_1.gguf, ")
    assert f"dtype {dtype}, device cpu (2 threads), attention cpu, " in summary
    # The CPU keeps GGUF's 4-bit weights in bfloat16 (layers/quantization).
    assert f"quantization {'gguf' if dtype == 'bfloat16' else 'none'}, " in summary
    assert "KV cache 100 blocks x 16 = 1,600 tokens" in summary


def test_a_native_build_says_it_starts(monkeypatch, tmp_path: Path, caplog):
    from torch.utils import cpp_extension

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "check_build_requirements", lambda: None)
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: "built")
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "ext.cpp").write_text("// nothing\n")
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        module = build.build_extension(
            "ext", csrc, ("ext.cpp",), ("-O0",), python_module=True, description="a test extension"
        )
    assert module == "built"
    build_dir = build.cache_dir(csrc, ("-O0",))
    assert f"building a test extension (about a minute the first time; cached in {build_dir})" in [
        record.getMessage() for record in caplog.records
    ]


def _generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedllm", "generate", "--max-tokens", "2", "--max-model-len", "256", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )


@pytest.mark.slow
def test_generate_logs_the_engine_and_says_why_an_output_stopped():
    result = _generate("The capital of France is")
    assert "INFO pagedllm.entrypoints.llm: engine ready in " in result.stderr
    assert "(1 output(s) stopped at --max-tokens 2; raise it for longer ones)" in result.stderr
    quiet = _generate("--log-level", "warning", "The capital of France is")
    assert "engine ready" not in quiet.stderr


@pytest.mark.slow
def test_serve_logs_the_engine_summary(launch_server, tiny_server_args: list[str]):
    server = launch_server(tiny_server_args)  # the engine in a process of its own
    log = server.log_tail()
    assert "INFO pagedllm.entrypoints.openai.api_server: engine ready in " in log
    assert "KV cache 2,048 blocks x 16 = 32,768 tokens" in log


def test_serve_on_a_taken_port_fails_before_loading_the_model(tiny_server_args: list[str]):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "pagedllm", "serve", *tiny_server_args, "--port", str(port)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"pagedllm serve: cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    # Refused before the engine was built: nothing was loaded.
    assert "engine ready" not in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_serve_starts_with_an_unwritable_cache_dir(launch_server, tmp_path: Path):
    blocker = tmp_path / "not-a-directory"  # nothing can be created under it, even by root
    blocker.write_text("")
    # The embedded GGUF: its tokenizer and config are what start-up caches. The CPU kernels'
    # and grammar extension's builds (a minute each) are left out; their fallback to a temporary
    # directory is test_cache_dir's.
    env = {
        "PAGEDLLM_CACHE_DIR": str(blocker / "cache"),
        "PAGEDLLM_CPU_KERNELS": "0",
        "PAGEDLLM_NATIVE_GRAMMAR": "0",
    }
    server = launch_server(["--max-model-len", "256", "--threads", "1"], env=env)
    assert "not caching the converted GGUF tokenizer in " in server.log_tail(20000)
    body = {"prompt": "The capital of France is", "max_tokens": 2}
    assert server.request("POST", "/v1/completions", body)[0] == 200


# Slow (~6 s): a CLI process on the embedded model.
@pytest.mark.slow
def test_generate_from_a_prompts_file_shows_a_progress_bar_on_stderr(
    tiny_llama_with_tokenizer: str, tmp_path
):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("one\ntwo\nthree\n")
    result = _generate("--model", tiny_llama_with_tokenizer, "--prompts-file", str(prompts_file))
    assert "Processed prompts" in result.stderr and "3/3" in result.stderr
    assert "Processed prompts" not in result.stdout and result.stdout.count("=== ") == 3
