"""The device n-gram lookup (worker/ngram_drafter.py) against a brute-force reference.

The reference walks every earlier position with Python loops: the longest common suffix (capped
at prompt_lookup_max, at least prompt_lookup_min), the latest among equals, the tokens after it,
continued periodically past the newest token; no match repeats the newest token. The host's
``NgramProposer`` (the scheduler's, without asynchronous scheduling) must pick the same match:
its drafts are a prefix of the device's."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedllm.core.spec_decode import NgramProposer
from pagedllm.spec_config import SpeculativeConfig
from pagedllm.worker.ngram_drafter import ngram_drafts


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    n = len(tokens) - 1
    best_len, best_end = 0, -1
    for end in range(n):
        length = 0
        while length < max_n and end - length >= 0 and tokens[end - length] == tokens[n - length]:
            length += 1
        if length >= best_len and length > 0:
            best_len, best_end = length, end
    if best_len < min_n:
        return [tokens[n]] * k
    period = n - best_end
    return [tokens[best_end + 1 + i % period] for i in range(k)]


def random_rows(rng: random.Random, num_rows: int, vocab: int) -> list[list[int]]:
    rows = []
    for i in range(num_rows):
        if i % 3 == 0:  # random: few matches
            rows.append([rng.randrange(vocab) for _ in range(rng.randint(1, 40))])
        else:  # a motif repeated, then edited: matches of every length
            motif = [rng.randrange(vocab) for _ in range(rng.randint(1, 7))]
            row = (motif * 30)[: rng.randint(2, 60)]
            for _ in range(rng.randint(0, 3)):
                row[rng.randrange(len(row))] = rng.randrange(vocab)
            rows.append(row)
    return rows


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("k", "min_n", "max_n"), [(3, 2, 4), (1, 1, 1), (5, 1, 5), (4, 3, 3), (8, 2, 6)])
def test_drafts_match_the_brute_force_lookup(seed, k, min_n, max_n):
    rng = random.Random(seed * 100 + k * 10 + max_n)
    rows = random_rows(rng, 13, vocab=rng.choice([3, 5, 50]))
    # Rows padded past their newest token with junk, as the device table holds stale drafts there.
    width = max(len(row) for row in rows) + rng.randint(0, 5)
    table = torch.tensor([row + [rng.randrange(50) for _ in range(width - len(row))] for row in rows])
    newest = torch.tensor([len(row) - 1 for row in rows])
    got = ngram_drafts(table, newest, k, min_n, max_n).tolist()
    assert got == [reference(row, k, min_n, max_n) for row in rows]
    host = NgramProposer(
        SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=min_n, prompt_lookup_max=max_n)
    )
    for row, drafts in zip(rows, got):
        found = host.propose(np.asarray(row, dtype=np.int64), k)
        assert drafts[: len(found)] == found


def test_int32_tables_and_a_single_token():
    table = torch.tensor([[7, 0, 0], [1, 2, 1]], dtype=torch.int32)
    drafts = ngram_drafts(table, torch.tensor([0, 2]), 3, 1, 2)
    assert drafts.dtype == torch.int32
    assert drafts.tolist() == [[7, 7, 7], [2, 1, 2]]


def test_tables_shorter_than_the_longest_lookup():
    # A request of two tokens right after its prompt: fewer positions than prompt_lookup_max.
    table = torch.tensor([[4, 4], [3, 9]])
    drafts = ngram_drafts(table, torch.tensor([1, 1]), 3, 1, 5)
    assert (
        drafts.tolist() == [reference([4, 4], 3, 1, 5), reference([3, 9], 3, 1, 5)] == [[4, 4, 4], [9, 9, 9]]
    )
