"""``pagedllm serve [MODEL]``: the flags, and the entry point the ``pagedllm`` command calls.

FastAPI, uvicorn and the engine's frontend (torch, transformers) are imported only when the server
starts, so ``pagedllm --help`` stays light; and only once the flags are checked, the port bound
and the engine's process started, so that a bad flag or a taken port fails at once, and the engine
process's imports and model load overlap the server's imports.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.engine_process import start_engine_core
from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.logger import DEFAULT_LOG_LEVEL, LOG_LEVELS, configure_logging

API_KEY_ENV = "PAGEDLLM_API_KEY"


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The server's flags, then every EngineArgs flag."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model to serve (same as --model); default: the embedded SmolLM2-135M-Instruct",
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every /v1 route (default: ${API_KEY_ENV} if set)",
    )
    server.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: MODEL)"
    )
    server.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=1 << 20,
        help="larger request bodies are refused with 413",
    )
    server.add_argument(
        "--stats-interval", type=float, default=10.0, help="seconds between stats log lines; 0: none"
    )
    server.add_argument(
        "--log-level",
        default=DEFAULT_LOG_LEVEL,
        choices=LOG_LEVELS,
        help="log level of the server and uvicorn",
    )
    server.add_argument(
        "--access-log", action=argparse.BooleanOptionalAction, default=True, help="log every request"
    )
    server.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render chat templates that requests bring (off: such requests get a 400)",
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model choose to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    server.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the format the model writes tool calls in (default: none)",
    )
    server.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="separate the model's reasoning into reasoning_content (default: none)",
    )
    server.add_argument(
        "--timeout-keep-alive", type=float, default=5.0, help="seconds an idle connection stays open"
    )
    server.add_argument(
        "--limit-concurrency",
        type=int,
        default=1024,
        help="most requests in progress at once (streams included, /health not); more get 503",
    )
    server.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine in a process of its own, so that HTTP work never delays a step "
        "(off: a thread of the server's process)",
    )
    server.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters to serve (with --enable-lora), each name=path or vLLM's JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a request\'s model field picks one',
    )
    EngineArgs.add_cli_args(parser)
    # A server serves streams: chunked prefill keeps a long prompt from stalling them for more
    # than one step (of max_num_batched_tokens tokens). Synchronous scheduling, because a request
    # arriving during an asynchronous step misses the step scheduled behind it: W4 at 32 req/s on
    # an H200, engine process, one call: p99 TTFT 79 ms synchronous against 105 ms asynchronous
    # (which halves TPOT; benchmarks/RESULTS.md).
    parser.set_defaults(enable_chunked_prefill=True, async_scheduling=False)
    return parser


def main(args: argparse.Namespace) -> None:
    """Serve until interrupted."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit(f"pagedllm serve: MODEL {args.model_tag!r} and --model {args.model!r} differ")
        args.model = args.model_tag
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    # Before the engine's process starts: it logs at this level too.
    configure_logging(args.log_level)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("pagedllm serve: --enable-auto-tool-choice needs --tool-call-parser")
    if args.lora_modules and not args.enable_lora:
        raise SystemExit("pagedllm serve: --lora-modules needs --enable-lora")
    try:
        lora_modules = parse_lora_modules(args.lora_modules or [])
    except ValueError as e:
        raise SystemExit(f"pagedllm serve: {e}") from e
    engine_args = EngineArgs.from_cli_args(args)
    sock = bind_port(args.host, args.port)
    try:
        # The engine's process imports torch and transformers and loads the model while this one
        # imports the server's modules (seconds each on a small machine), not after.
        started = start_engine_core(engine_args) if args.engine_process else None
        try:
            from pagedllm.entrypoints.openai.api_server import run_server

            run_server(args, sock, lora_modules, started)
        finally:
            if started is not None:
                started.close()  # a no-op unless the server failed before it took the engine
    finally:
        sock.close()


def parse_lora_modules(values: list[str]) -> list[tuple[str, str, str | None]]:
    """``--lora-modules`` entries, ``name=path`` or vLLM's JSON form ``{"name": ..., "path": ...,
    "base_model_name": ...}``, as (name, path, base model name or None)."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
                modules.append((entry["name"], entry["path"], entry.get("base_model_name")))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules: {value!r} is not a JSON object with name and path") from e
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {value!r} must be name=path or a JSON object")
        modules.append((name, path, None))
    return modules


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not listening yet: a client connecting while the model
    loads is refused rather than left waiting). Binding before loading means a taken port fails
    in a second, not after the minute the model takes; SystemExit names the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # As uvicorn does: a port left in TIME_WAIT by the last server can be bound again at once.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = " (another server is using it; pick one with --port)" if e.errno == errno.EADDRINUSE else ""
        raise SystemExit(f"pagedllm serve: cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    return sock
