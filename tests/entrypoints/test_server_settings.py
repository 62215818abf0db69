"""Server settings that need no running server: log levels, the served model's name, the serve
command's defaults."""

from __future__ import annotations

import argparse
import logging

from pagedllm.entrypoints.openai.api_server import default_model_name
from pagedllm.entrypoints.openai.cli import add_cli_args
from pagedllm.logger import configure_logging


def test_log_level_reaches_pagedllm_loggers_whatever_the_root_logger_says(monkeypatch):
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", logging.WARNING)
    package = logging.getLogger("pagedllm")
    # Restored after the test: other tests capture pagedllm's logs through the root logger.
    monkeypatch.setattr(package, "handlers", [])
    monkeypatch.setattr(package, "propagate", package.propagate)
    monkeypatch.setattr(package, "level", package.level)
    configure_logging("info")
    assert logging.getLogger("pagedllm.metrics").isEnabledFor(logging.INFO)
    assert package.handlers and not package.propagate
    configure_logging("error")
    assert not logging.getLogger("pagedllm.metrics").isEnabledFor(logging.INFO)
    assert len(package.handlers) == 1


def _args(*argv: str) -> argparse.Namespace:
    args = add_cli_args(argparse.ArgumentParser()).parse_args(list(argv))
    args.model = args.model or args.model_tag
    return args


def test_the_served_name_is_never_the_weights_path():
    assert default_model_name(_args("/srv/models/Qwen3-0.6B/")) == "Qwen3-0.6B"
    assert default_model_name(_args("/srv/models/smol.Q4.gguf")) == "smol.Q4.gguf"
    assert default_model_name(_args("/srv/m", "--served-model-name", "prod")) == "prod"


def test_serve_turns_chunked_prefill_on_unless_told_not_to():
    assert _args().enable_chunked_prefill is True
    assert _args("--no-enable-chunked-prefill").enable_chunked_prefill is False


def test_serve_schedules_synchronously_unless_told_otherwise():
    # Latency first: a request arriving during an asynchronous step waits one more step.
    assert _args().async_scheduling is False
    assert _args("--async-scheduling").async_scheduling is True
