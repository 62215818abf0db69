"""The one-launch take-back (kernels/triton/take_back.py) against its torch form
(worker/take_back.py: ``take_back_torch``) and a plain loop: positions, lengths and slots of a
step of decodes and expanded verifications moved back by each request's rejected drafts, over
shuffled block tables wider than the rows they are read from, step sizes across the kernel's
256-token blocks, and counts from none to all of a request's drafts.

On the CPU the kernel runs under Triton's interpreter (tests/kernels/conftest.py sets it).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton", reason="the kernel needs the triton package")

from pagedllm.kernels.triton.take_back import take_back
from pagedllm.worker.take_back import take_back_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _step(rng: random.Random, num_reqs: int, k: int, block_size: int):
    """(rejected, token_req, positions, seq_lens, block_tables, slot_mapping) of a step whose
    requests verify 0..k drafts each (1 + drafts tokens), every token a sequence of its own, its
    block table row a copy of its request's; the slots planned over the optimistic positions."""
    width = 64
    tables = torch.randperm(num_reqs * width, generator=torch.Generator().manual_seed(rng.randrange(99)))
    tables = tables.view(num_reqs, width).to(torch.int32)
    token_req, positions, rejected = [], [], []
    for r in range(num_reqs):
        drafts = rng.randint(0, k)
        in_flight = rng.randint(0, k)  # the step in flight's drafts, counted as accepted
        rejected.append(rng.randint(0, in_flight))
        start = rng.randint(in_flight, (width - 1) * block_size - k - 1)
        token_req += [r] * (1 + drafts)
        positions += range(start, start + 1 + drafts)
    token_req_t = torch.tensor(token_req, dtype=torch.int32)
    positions_t = torch.tensor(positions, dtype=torch.int64)
    block_tables = torch.zeros(len(token_req) + 5, width + 3, dtype=torch.int32)  # wider, more rows
    block_tables[: len(token_req), :width] = tables[token_req_t.long()]
    seq_lens = (positions_t + 1).to(torch.int32)
    slots = block_tables[: len(token_req)].gather(1, (positions_t // block_size)[:, None])[:, 0]
    slot_mapping = slots.to(torch.int64) * block_size + positions_t % block_size
    pad = torch.full((5,), -7, dtype=torch.int64)  # rows past the step: never touched
    return (
        torch.tensor(rejected, dtype=torch.int64),
        token_req_t,
        torch.cat([positions_t, pad]),
        torch.cat([seq_lens, pad.to(torch.int32)]),
        block_tables,
        torch.cat([slot_mapping, pad]),
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("num_reqs", "k", "block_size"), [(1, 3, 16), (7, 3, 16), (70, 4, 8), (130, 2, 32)])
def test_matches_the_torch_form_and_a_plain_loop(seed, num_reqs, k, block_size):
    rng = random.Random(seed * 7 + num_reqs)
    step = _step(rng, num_reqs, k, block_size)
    rejected, token_req, positions, seq_lens, block_tables, slot_mapping = step
    n = len(token_req)
    expected_pos = positions.clone()
    expected_len = seq_lens.clone()
    expected_slot = slot_mapping.clone()
    for t in range(n):
        back = int(rejected[int(token_req[t])])
        expected_pos[t] -= back
        expected_len[t] -= back
        p = int(expected_pos[t])
        expected_slot[t] = int(block_tables[t, p // block_size]) * block_size + p % block_size
    for form in (take_back, take_back_torch):
        full = [x.clone().to(DEVICE) for x in (positions, seq_lens, block_tables, slot_mapping)]
        pos, lens, tables, slots = full
        # The step's rows only, as the runner passes them: views of longer buffers, whose rows
        # past the step must stay as they are.
        form(rejected.to(DEVICE), token_req.to(DEVICE), pos[:n], lens[:n], tables[:n], slots[:n], block_size)
        assert torch.equal(pos.cpu(), torch.cat([expected_pos[:n], positions[n:]]))
        assert torch.equal(lens.cpu(), torch.cat([expected_len[:n], seq_lens[n:]]))
        assert torch.equal(slots.cpu(), torch.cat([expected_slot[:n], slot_mapping[n:]]))
        assert torch.equal(tables.cpu(), block_tables)


def test_an_empty_step_launches_nothing():
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    take_back(
        empty,
        empty.to(torch.int32),
        empty,
        empty.to(torch.int32),
        torch.empty(0, 4, dtype=torch.int32, device=DEVICE),
        empty,
        16,
    )
