"""Scoring with an embedding model (``LLM.score``, ``/v1/score``, ``/v1/rerank``), as vLLM does it
for embedding models: every text is embedded once, and a pair's score is the cosine similarity
of its two embeddings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def pair_inputs(
    data_1: T | Sequence[T],
    data_2: T | Sequence[T],
    is_single: type | tuple,
    names: tuple[str, str] = ("text_1", "text_2"),
) -> list[tuple[T, T]]:
    """vLLM's pairing: one first input against each of the second ones (1 -> N), or the two
    lists one for one (N -> N). ``is_single`` tells one input from a list of them (str: text).
    ValueError naming the inputs (``names``) otherwise."""
    name_1, name_2 = names
    firsts = [data_1] if isinstance(data_1, is_single) else list(data_1)
    seconds = [data_2] if isinstance(data_2, is_single) else list(data_2)
    if not firsts or not seconds:
        raise ValueError(f"{name_1} and {name_2} must each hold at least one input")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(
            f"{name_1} has {len(firsts)} inputs and {name_2} {len(seconds)}: "
            f"give one {name_1}, or as many as {name_2}"
        )
    return list(zip(firsts, seconds))


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """a, b: two embeddings of one size (truncated or normalized alike) -> their cosine."""
    a_, b_ = torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)
    return torch.nn.functional.cosine_similarity(a_, b_, dim=0).item()
