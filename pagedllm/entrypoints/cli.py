"""The ``pagedllm`` command: generate, chat, serve, bench.

Building the parser imports neither torch nor the engine (seconds on a small machine): each
command imports what it runs when it runs, so ``pagedllm --help`` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import sys
import time
from collections.abc import Sequence

from pagedllm import __version__
from pagedllm.engine.arg_utils import EngineArgs, cli_type
from pagedllm.entrypoints.openai import cli as openai_cli
from pagedllm.logger import DEFAULT_LOG_LEVEL, FORMAT, LOG_LEVELS, configure_logging
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The benchmarks (modules of pagedllm.entrypoints.bench) and their one-line help.
BENCHMARKS = {
    "throughput": "offline throughput: W1, W2, W5, W6, W7",
    "latency": "single-request latency: W3",
    "serve": "online serving against an OpenAI-compatible endpoint: W4",
    "kernels": "paged decode attention bandwidth: K1",
    "mla": "MLA decode kernel against FlashInfer's MLA decode: K1-MLA",
    "moe": "fused MoE kernel against the per-expert torch reference",
    "lora": "LoRA BGMV and SGMV shrink/expand kernels against the masked torch product",
    "quant": "quantized GEMM paths (FP8, W4A16; decode to prefill) at Llama-3.1-8B's layer shapes",
}

# The sampling options the CLI exposes; names, types and defaults come from SamplingParams.
_SAMPLING_OPTIONS = {
    "n": "output sequences per prompt",
    "temperature": "0 is greedy",
    "top_p": "nucleus sampling, in (0, 1]",
    "top_k": "-1 keeps every token",
    "min_p": "drop tokens below min_p times the most likely one",
    "max_tokens": "most tokens to generate per output; an output cut here ends mid-sentence",
    "min_tokens": "tokens before EOS may end the output",
    "ignore_eos": "keep going after EOS",
    "seed": "this request's own sampling seed (default: none, the engine's generator, seeded by --seed)",
}


def _add_sampling_args(parser: argparse.ArgumentParser, defaults: dict[str, object]) -> None:
    fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    group = parser.add_argument_group("sampling")
    for name, help_text in _SAMPLING_OPTIONS.items():
        f = fields[name]
        # The engine owns --seed; the request's own is --sampling-seed.
        dest = "sampling_seed" if name == "seed" else name
        flag = "--" + dest.replace("_", "-")
        default = defaults.get(name, f.default)
        if f.type == "bool":
            group.add_argument(
                flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        else:
            group.add_argument(flag, dest=dest, type=cli_type(f.type), default=default, help=help_text)
    group.add_argument(
        "--stop", action="append", default=None, help="a stop string (repeatable; default: none)"
    )


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    values = {name: getattr(args, "sampling_seed" if name == "seed" else name) for name in _SAMPLING_OPTIONS}
    return SamplingParams(stop=args.stop, **values)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            text = f.read()
        # A JSON list of strings, or one prompt per line.
        if text.lstrip().startswith("["):
            prompts += json.loads(text)
        else:
            prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SystemExit("pagedllm generate: give prompts as arguments or with --prompts-file")
    return prompts


def cmd_generate(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.llm import LLM

    prompts = _read_prompts(args)
    params = _sampling_params(args)
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    # A file's prompts get a progress bar (tqdm's, on stderr: stdout stays the outputs).
    use_tqdm = args.prompts_file is not None
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=use_tqdm)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    num_failed = 0
    for prompt, output in zip(prompts, outputs):
        if len(prompts) > 1:
            print(f"=== {prompt}")
        if output.error:
            num_failed += 1
            print(f"error: {output.error}", file=sys.stderr)
        for completion in output.outputs:
            print(completion.text.strip() if args.chat else completion.text)
    num_cut = sum(c.finish_reason == "length" for output in outputs for c in output.outputs)
    if num_cut:
        # Else an answer that stops mid-sentence looks like a fault.
        print(
            f"({num_cut} output(s) stopped at --max-tokens {params.max_tokens}; raise it for longer ones)",
            file=sys.stderr,
        )
    if num_failed:
        raise SystemExit(f"pagedllm generate: {num_failed} of {len(prompts)} prompts failed")


def cmd_chat(args: argparse.Namespace) -> None:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.chat import ChatSession, run_chat
    from pagedllm.entrypoints.utils import engine_summary

    start = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    logger.info("%s", engine_summary(engine.config, engine.num_gpu_blocks, time.perf_counter() - start))
    run_chat(ChatSession(engine, _sampling_params(args), args.system))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default, except where the help already tells it or there
    is none to show: a default of None (the help says what happens without the option) and a bare
    switch (off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        is_switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if action.default is None or is_switch or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _add_log_level_arg(parser: argparse.ArgumentParser) -> None:
    # serve has its own (openai/cli.py), which uvicorn's logs follow too.
    parser.add_argument(
        "--log-level",
        default=DEFAULT_LOG_LEVEL,
        choices=LOG_LEVELS,
        help="the level of pagedllm's log lines on stderr (info: start-up's steps and the engine "
        "summary; debug: the options in effect too)",
    )


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``pagedllm`` parser. A benchmark's flags come from its module, which imports torch and
    the engine: given ``argv``, the command line about to be parsed, only the benchmark it names
    is imported (None: every one). ``bench``'s own parser has no options, so the benchmark's name
    is the token after ``bench``."""
    parser = argparse.ArgumentParser(
        prog="pagedllm", description="LLM inference with PagedAttention", formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    generate = sub.add_parser(
        "generate", help="answer prompts and print the outputs", formatter_class=HelpFormatter
    )
    generate.add_argument("prompts", nargs="*", help="prompts (or use --prompts-file)")
    generate.add_argument(
        "--prompts-file",
        help="a file with one prompt per line, or a JSON list of strings (shows a progress bar)",
    )
    generate.add_argument(
        "--chat", action="store_true", help="send each prompt as a user message via the chat template"
    )
    _add_log_level_arg(generate)
    _add_sampling_args(generate, {})
    EngineArgs.add_cli_args(generate)
    generate.set_defaults(func=cmd_generate)

    chat = sub.add_parser(
        "chat", help="chat interactively, streaming the replies", formatter_class=HelpFormatter
    )
    chat.add_argument("--system", help="a system message (default: none)")
    _add_log_level_arg(chat)
    _add_sampling_args(chat, {"max_tokens": 512, "temperature": 0.7})
    EngineArgs.add_cli_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API", formatter_class=HelpFormatter
    )
    openai_cli.add_cli_args(serve)
    serve.set_defaults(func=openai_cli.main)

    bench = sub.add_parser(
        "bench", help="benchmarks (benchmarks/README.md's workloads)", formatter_class=HelpFormatter
    )
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    named = argv[1] if argv is not None and len(argv) > 1 and argv[0] == "bench" else None
    for name, help_text in BENCHMARKS.items():
        command = bench_sub.add_parser(name, help=help_text, formatter_class=HelpFormatter)
        _add_log_level_arg(command)
        if argv is None or name == named:
            module = importlib.import_module(f"pagedllm.entrypoints.bench.{name}")
            module.add_cli_args(command)
            command.set_defaults(func=module.main)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    # Other libraries' warnings in pagedllm's format; pagedllm's own lines at --log-level.
    logging.basicConfig(level=logging.WARNING, format=FORMAT)
    configure_logging(args.log_level)
    options = {k: "<set>" if k == "api_key" and v else v for k, v in vars(args).items() if k != "func"}
    logger.debug("options: %s", options)
    try:
        args.func(args)
    except (ValueError, NotImplementedError) as e:
        raise SystemExit(f"pagedllm {args.command}: {e}") from e


if __name__ == "__main__":
    main()
