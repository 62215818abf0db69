"""The one-launch n-gram lookup (kernels/triton/ngram_lookup.py) against its torch form
(worker/ngram_drafter.py: ``ngram_drafts``, itself checked against a brute-force reference in
tests/worker/test_ngram_drafter.py): the same drafts for tables of repeated motifs and random
tokens, newest positions from the first token to the table's last column, rows read out of order
from a wider table, every lookup bound and draft count.

On the CPU the kernel runs under Triton's interpreter (tests/kernels/conftest.py sets it).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton", reason="the kernel needs the triton package")

from pagedllm.kernels.triton.ngram_lookup import ngram_lookup
from pagedllm.worker.ngram_drafter import ngram_drafts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _table(rng: random.Random, num_rows: int, width: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    table = torch.randint(0, vocab, (num_rows, width), generator=generator)
    for row in range(num_rows):
        if rng.random() < 0.6:  # a motif repeated: matches of every length
            motif = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
            table[row] = torch.tensor((motif * width)[:width])
    return table.to(torch.int32)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(("k", "min_n", "max_n"), [(3, 2, 4), (1, 1, 1), (5, 1, 5), (4, 3, 3), (9, 2, 6)])
def test_matches_the_torch_form(seed, k, min_n, max_n):
    rng = random.Random(seed * 31 + k)
    # Widths across the kernel's 256-position blocks, down to a single token.
    width = rng.choice([1, 3, 40, 255, 300, 600])
    table = _table(rng, 9, width, rng.choice([2, 5, 50]))
    rows = torch.tensor(rng.sample(range(9), 6))
    newest = torch.tensor([rng.randrange(width) for _ in range(5)] + [width - 1])
    got = ngram_lookup(table.to(DEVICE), rows.to(DEVICE), newest.to(DEVICE), k, min_n, max_n)
    want = ngram_drafts(table.index_select(0, rows), newest, k, min_n, max_n)
    assert got.cpu().tolist() == want.tolist()


def test_no_requests():
    table = torch.zeros((2, 4), dtype=torch.int32, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert ngram_lookup(table, none, none, 3, 1, 2).shape == (0, 3)
