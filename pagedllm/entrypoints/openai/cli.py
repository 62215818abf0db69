"""``pagedllm serve [MODEL]``: the flags, and the entry point the ``pagedllm`` command calls.

FastAPI and uvicorn are imported only when the server starts, so ``pagedllm --help`` stays light.
"""

from __future__ import annotations

import argparse
import os

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.logger import DEFAULT_LOG_LEVEL, LOG_LEVELS

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
    from pagedllm.entrypoints.openai.api_server import run_server

    run_server(args)
