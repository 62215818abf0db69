"""The one-launch verification of greedy requests' drafts (kernels/triton/greedy_verify.py) against
the rejection sampler's torch form (sample/rejection_sampler.py): the same emitted tokens, accepted
counts and row indices, for requests of 0 to K drafts, drafts that match the target's argmax up to
every position, and synthetic acceptance (the same ``torch.rand`` draws).

On the CPU the kernel runs under Triton's interpreter (tests/kernels/conftest.py sets it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="the kernel needs the triton package")

from pagedllm.kernels.triton.greedy_verify import greedy_verify
from pagedllm.sample.rejection_sampler import rejection_sample

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(num_drafts: list[int], seed: int) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
    """Drafts that follow the target's argmax for a random prefix, then differ (or not at all)."""
    generator = torch.Generator().manual_seed(seed)
    k = np.asarray(num_drafts, dtype=np.int64)
    max_k = max(int(k.max()), 1)
    argmax = torch.randint(0, 50, (int((k + 1).sum()),), generator=generator)
    drafts = torch.full((len(k), max_k), -1, dtype=torch.int64)
    first = np.cumsum(k + 1) - (k + 1)
    for i, (n, row) in enumerate(zip(k.tolist(), first.tolist())):
        agree = int(torch.randint(0, n + 1, (1,), generator=generator))
        for j in range(n):
            target = int(argmax[row + j])
            drafts[i, j] = target if j < agree else (target + 1) % 50
    return drafts.to(DEVICE), k, argmax.to(DEVICE)


@pytest.mark.parametrize("rate", [None, 0.0, 0.6, 1.0])
@pytest.mark.parametrize(
    "num_drafts", [[3], [0], [3, 0, 1, 3, 2], [1] * 7, [5, 4, 3, 2, 1, 0], [16, 2]], ids=str
)
def test_the_kernel_emits_what_the_torch_rejection_sampler_emits(num_drafts, rate):
    for seed in range(3):
        drafts, k, argmax = _case(num_drafts, seed)
        torch.manual_seed(seed)
        expected = rejection_sample(drafts, torch.from_numpy(k).to(DEVICE), argmax, None, None, None, rate)
        torch.manual_seed(seed)
        output, num_accepted, row_index = greedy_verify(drafts, k, argmax, rate)
        assert output.tolist() == expected.output_token_ids.tolist()
        assert num_accepted.tolist() == expected.num_accepted.tolist()
        assert row_index.tolist() == expected.row_index.tolist()


def test_a_prefix_match_by_hand():
    # Request 0: drafts 4 5 6 against argmax 4 5 9 9 -> accepts 2, emits 4 5 9. Request 1: draft 7
    # against argmax 7 8 -> accepts 1, emits 7 8 (the bonus). Request 2: no drafts, emits 3.
    drafts = torch.tensor([[4, 5, 6], [7, -1, -1], [-1, -1, -1]], device=DEVICE)
    argmax = torch.tensor([4, 5, 9, 9, 7, 8, 3], device=DEVICE)
    output, num_accepted, row_index = greedy_verify(drafts, np.array([3, 1, 0]), argmax)
    assert output.tolist() == [[4, 5, 9, -1], [7, 8, -1, -1], [3, -1, -1, -1]]
    assert num_accepted.tolist() == [2, 1, 0]
    assert row_index.tolist() == [[0, 1, 2, 3], [4, 5, 5, 5], [6, 6, 6, 6]]
