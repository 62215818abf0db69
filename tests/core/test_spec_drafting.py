"""Speculative decoding in the core: the n-gram drafter against a naive search, drafts scheduled
as more tokens to compute, and a verification's rollback of progress and blocks.

The model is not run: the tests feed ``update_from_output`` the rows a verification would return.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.spec_decode import NgramProposer, max_num_drafts
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_config import SpeculativeConfig
from pagedllm.step_io import ModelRunnerOutput

BLOCK_SIZE = 4


def naive_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest suffix of n in [min_n, max_n] tokens that occurs earlier (not as the suffix
    itself), at its latest such occurrence: the k tokens after it."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize("seed", range(30))
def test_ngram_proposer_matches_a_naive_search(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 20])
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
    min_n = rng.randint(1, 3)
    max_n = rng.randint(min_n, 5)
    k = rng.randint(1, 5)
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=min_n, prompt_lookup_max=max_n))
    assert proposer.propose(np.asarray(tokens), k) == naive_ngram(tokens, min_n, max_n, k)


def test_ngram_proposer_continues_a_repeated_text():
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=3))
    text = [5, 6, 7, 8, 9, 1, 2, 5, 6]
    assert proposer.propose(np.asarray(text), 3) == [7, 8, 9]
    assert proposer.propose(np.asarray([1, 2, 3, 4]), 3) == []  # nothing recurs


def make_scheduler(num_gpu_blocks: int = 32, k: int = 4, max_model_len: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=max_model_len)
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=2)
    scheduler = Scheduler(config, BLOCK_SIZE, num_gpu_blocks, 0, speculative_config=spec)
    scheduler.kv_cache_manager.watermark_blocks = 0
    return scheduler


def add(
    scheduler: Scheduler, prompt: list[int], max_tokens: int = 32, stop_token_ids: list[int] | None = None
) -> Request:
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop_token_ids
    )
    request = Request(scheduler.new_req_id(), prompt, params, BLOCK_SIZE)
    scheduler.add_request(request)
    return request


def run_prefill(scheduler: Scheduler, request: Request, token: int) -> None:
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {request.req_id: len(request.prompt_token_ids)}
    scheduler.update_from_output(out, ModelRunnerOutput([request.req_id], [token], [0.0]))


def test_drafts_are_scheduled_after_the_newest_token_and_rejected_ones_rolled_back():
    scheduler = make_scheduler()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4]  # 13 tokens: blocks 0-3
    request = add(scheduler, prompt)
    run_prefill(scheduler, request, 5)  # tokens: ... 3 4 5, drafts continue 6 7 8 9
    kv = scheduler.kv_cache_manager
    free_before = kv.get_num_free_gpu_blocks()
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {request.req_id: [6, 7, 8, 9]}
    assert out.num_scheduled_tokens == {request.req_id: 5}
    assert request.num_computed_tokens == 13 + 5  # through the drafts
    # Positions 13 .. 17 need blocks 3 and 4: one more block.
    assert kv.get_num_free_gpu_blocks() == free_before - 1
    # The first draft is accepted, the second rejected: 6, then the target's 2.
    result = scheduler.update_from_output(
        out,
        ModelRunnerOutput([request.req_id] * 2, [6, 2], [0.0, 0.0], num_accepted_tokens={request.req_id: 1}),
    )
    assert [row for _, row in result.appended] == [0, 1]
    assert request.output_token_ids == [5, 6, 2]
    assert request.num_computed_tokens == 15  # prompt, 5, 6 computed; 2 is the next input
    assert request.num_output_placeholders == 0
    # 16 tokens fill 4 blocks: the block that held only rejected drafts is free again.
    assert kv.get_num_free_gpu_blocks() == free_before
    assert request.group.metrics.spec_num_draft_tokens == 4
    assert request.group.metrics.spec_num_accepted_tokens == 1
    assert scheduler.spec_decoding.num_accepted_tokens_per_pos == [1, 0, 0, 0]


def test_a_stop_inside_the_accepted_drafts_ends_the_request_there():
    scheduler = make_scheduler()
    request = add(scheduler, [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], max_tokens=32, stop_token_ids=[5])
    run_prefill(scheduler, request, 4)
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {request.req_id: [5, 6, 7, 8]}
    scheduler.update_from_output(
        out,
        ModelRunnerOutput(
            [request.req_id] * 5, [5, 6, 7, 8, 9], [0.0] * 5, num_accepted_tokens={request.req_id: 4}
        ),
    )
    assert request.output_token_ids == [4, 5]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert scheduler.kv_cache_manager.get_num_requests_with_blocks() == 0


def test_drafts_are_cut_to_max_tokens_the_context_and_the_token_budget():
    scheduler = make_scheduler(max_model_len=64)
    request = add(scheduler, [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], max_tokens=3)
    run_prefill(scheduler, request, 4)
    assert max_num_drafts(request, 4, 64) == 1  # 1 output, 1 draft, 1 more: max_tokens 3
    assert max_num_drafts(request, 4, 14) == 1  # 12 tokens, 1 draft, 1 more: a context of 14
    assert max_num_drafts(request, 4, 13) == 0
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {request.req_id: [5]}


def test_without_free_blocks_for_its_drafts_a_request_decodes_one_token():
    # 4 blocks of 4: an 11-token prompt takes 3, a 3-token one the last.
    scheduler = make_scheduler(num_gpu_blocks=4)
    request = add(scheduler, [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3])
    other = add(scheduler, [9, 9, 9])
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {request.req_id: 11, other.req_id: 3}
    scheduler.update_from_output(out, ModelRunnerOutput([request.req_id, other.req_id], [4, 7], [0.0, 0.0]))
    out = scheduler.schedule()
    # Its drafts (5 6 7 8) would need a fifth block: it decodes its token alone, preempting nobody.
    assert out.num_scheduled_tokens == {request.req_id: 1, other.req_id: 1}
    assert out.scheduled_spec_decode_tokens == {}
    assert not scheduler.last_preemptions
