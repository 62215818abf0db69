"""The ``pagedllm`` command: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Callable

from pagedllm.engine.arg_utils import EngineArgs, cli_type
from pagedllm.entrypoints.bench import kernels as bench_kernels
from pagedllm.entrypoints.bench import latency as bench_latency
from pagedllm.entrypoints.bench import moe as bench_moe
from pagedllm.entrypoints.bench import serve as bench_serve
from pagedllm.entrypoints.bench import throughput as bench_throughput
from pagedllm.entrypoints.openai import cli as openai_cli
from pagedllm.sampling_params import SamplingParams

# The sampling options the CLI exposes; names, types and defaults come from SamplingParams.
_SAMPLING_OPTIONS = {
    "n": "output sequences per prompt",
    "temperature": "0 is greedy",
    "top_p": "nucleus sampling, in (0, 1]",
    "top_k": "-1 keeps every token",
    "min_p": "drop tokens below min_p times the most likely one",
    "max_tokens": "most tokens to generate",
    "min_tokens": "tokens before EOS may end the output",
    "ignore_eos": "keep going after EOS",
    "seed": "this request's sampling seed",
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
    group.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


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
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    num_failed = 0
    for prompt, output in zip(prompts, outputs):
        if len(prompts) > 1:
            print(f"=== {prompt}")
        if output.error:
            num_failed += 1
            print(f"error: {output.error}", file=sys.stderr)
        for completion in output.outputs:
            print(completion.text.strip() if args.chat else completion.text)
    if num_failed:
        raise SystemExit(f"pagedllm generate: {num_failed} of {len(prompts)} prompts failed")


def cmd_chat(args: argparse.Namespace) -> None:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.tokenizer import apply_chat_template

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    if engine.tokenizer is None:
        raise SystemExit("pagedllm chat: this model has no tokenizer")
    params = _sampling_params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Chat with the model; an empty line or Ctrl-D ends.", file=sys.stderr)
    for turn in range(sys.maxsize):
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        token_ids = apply_chat_template(engine.tokenizer, messages)
        engine.add_request(str(turn), sampling_params=params, prompt_token_ids=token_ids)
        reply = _stream_reply(engine, lambda text: print(text, end="", flush=True))
        print()
        messages.append({"role": "assistant", "content": reply})


def _stream_reply(engine, write: Callable[[str], None]) -> str:
    """Step the engine until its one request finishes, writing text as it arrives."""
    text = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.error:
                raise SystemExit(f"error: {output.error}")
            new_text = output.outputs[0].text
            write(new_text[len(text) :])
            text = new_text
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference with PagedAttention")
    sub = parser.add_subparsers(dest="command", required=True)

    generate = sub.add_parser("generate", help="answer prompts and print the outputs")
    generate.add_argument("prompts", nargs="*", help="prompts (or use --prompts-file)")
    generate.add_argument("--prompts-file", help="a file with one prompt per line, or a JSON list of strings")
    generate.add_argument(
        "--chat", action="store_true", help="send each prompt as a user message via the chat template"
    )
    _add_sampling_args(generate, {})
    EngineArgs.add_cli_args(generate)
    generate.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat interactively, streaming the replies")
    chat.add_argument("--system", help="a system message")
    _add_sampling_args(chat, {"max_tokens": 512, "temperature": 0.7})
    EngineArgs.add_cli_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    openai_cli.add_cli_args(serve)
    serve.set_defaults(func=openai_cli.main)

    bench = sub.add_parser("bench", help="benchmarks (benchmarks/README.md's workloads)")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    for name, module, help_text in (
        ("throughput", bench_throughput, "offline throughput: W1, W2, W5"),
        ("latency", bench_latency, "single-request latency: W3"),
        ("serve", bench_serve, "online serving against an OpenAI-compatible endpoint: W4"),
        ("kernels", bench_kernels, "paged decode attention bandwidth: K1"),
        ("moe", bench_moe, "fused MoE kernel against the per-expert torch reference"),
    ):
        command = bench_sub.add_parser(name, help=help_text)
        module.add_cli_args(command)
        command.set_defaults(func=module.main)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, NotImplementedError) as e:
        raise SystemExit(f"pagedllm {args.command}: {e}") from e


if __name__ == "__main__":
    main()
