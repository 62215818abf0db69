"""pagedllm's log handler: one place that sets it up, for the server and for the processes it
starts (the engine process is spawned: it inherits no logging configuration)."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The levels every ``pagedllm`` command takes as --log-level; its default is INFO (start-up's
# steps and the engine summary shown, as vLLM's commands show them).
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
DEFAULT_LOG_LEVEL = "info"


def configure_logging(log_level: str | int) -> None:
    """pagedllm's loggers at ``log_level`` with their own handler: uvicorn and other libraries
    configure the root logger their own way, which must not silence ours."""
    level = log_level.upper() if isinstance(log_level, str) else log_level
    package_logger = logging.getLogger("pagedllm")
    package_logger.setLevel(level)
    if not package_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        package_logger.addHandler(handler)
    package_logger.propagate = False


def configured_level() -> int | None:
    """The level configure_logging set in this process, None if it was not called (a library
    user's own configuration then applies, which a spawned process cannot inherit)."""
    package_logger = logging.getLogger("pagedllm")
    return package_logger.level if package_logger.handlers and not package_logger.propagate else None
