"""Giving the engine's freed heap back to the operating system.

A serving engine allocates and frees host memory of many sizes every step (the step's arrays,
tensors for each batch shape, per-request state). glibc's malloc keeps what is freed inside its
arenas for reuse and returns the top of an arena only; freed chunks below a live one stay
resident. Under churn (requests of every length, clients hanging up mid-stream), the resident set
of the engine process grew by about 60 MB per round of 500 streams in `benchmarks/soak.py` with
no live object behind it: `malloc_trim(0)` after each round gave nearly all of it back and kept
the process flat. The engine loop calls ``release_free_heap`` when it falls idle, at most every
``MIN_INTERVAL_S`` (a trim walks the heap).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

MIN_INTERVAL_S = 1.0


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


class HeapTrimmer:
    """``maybe_trim()``: give the free heap back, unless done less than ``interval_s`` ago."""

    def __init__(self, interval_s: float = MIN_INTERVAL_S) -> None:
        self._trim = _malloc_trim()
        self._interval_s = interval_s
        self._last = float("-inf")

    def maybe_trim(self) -> None:
        if self._trim is None or time.monotonic() - self._last < self._interval_s:
            return
        start = time.monotonic()
        self._trim(0)
        self._last = time.monotonic()
        logger.debug("returned the free heap to the OS in %.1f ms", 1000 * (self._last - start))
