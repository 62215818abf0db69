"""The sampler's logprobs: the chosen tokens' log_softmax of the raw logits, before penalties
and min_tokens bans (which edit the logits in place), as vLLM reports them."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler


def metadata(
    num_rows: int, vocab: int, *, greedy: bool, top: int, penalties: bool, ban: bool
) -> SamplingMetadata:
    md = SamplingMetadata(
        temperature=None if greedy else torch.full((num_rows,), 0.7),
        greedy=None if greedy else torch.zeros(num_rows, dtype=torch.bool),
        all_greedy=greedy,
        max_num_top_tokens=top,
    )
    if penalties:
        md.presence_penalty = torch.full((num_rows,), 0.5)
        md.frequency_penalty = torch.full((num_rows,), 0.3)
        md.output_counts = torch.randint(0, 3, (num_rows, vocab)).float()
    if ban:
        md.banned_rows = torch.arange(num_rows).repeat_interleave(2)
        md.banned_token_ids = torch.tensor([0, 1]).repeat(num_rows)
    return md


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("top", [0, 3])
@pytest.mark.parametrize("penalties", [False, True])
@pytest.mark.parametrize("ban", [False, True])
def test_chosen_logprobs_are_the_raw_logits_log_softmax(greedy, top, penalties, ban) -> None:
    torch.manual_seed(0)
    num_rows, vocab = 6, 50
    logits = torch.randn(num_rows, vocab) * 4
    logits[:, :2] += 6  # the banned tokens would win if they were not banned
    expected_logprobs = torch.log_softmax(logits, dim=-1)
    md = metadata(num_rows, vocab, greedy=greedy, top=top, penalties=penalties, ban=ban)
    out = Sampler()(logits.clone(), md)
    chosen = expected_logprobs.gather(-1, out.token_ids[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs, chosen, rtol=0, atol=1e-5)
    if ban:
        assert not torch.isin(out.token_ids, torch.tensor([0, 1])).any()
    if top:
        torch.testing.assert_close(out.top_logprobs, expected_logprobs.topk(top, dim=-1).values)
    else:
        assert out.top_logprobs is None and out.ranks is None
