"""Holding back text that may be the start of a marker (a tag, a special token's text) until the
next delta tells: what reasoning and tool-call parsers share when they read a stream."""

from __future__ import annotations


def held_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``: text that
    may become the marker once more arrives."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0
