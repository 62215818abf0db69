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
from pagedllm.step_io import DRAFT_PLACEHOLDER, ModelRunnerOutput

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


def test_ngram_drafts_follow_a_growing_request_as_a_fresh_search_would():
    """draft() keeps each request's tokens as an array it extends by the new outputs (capacity
    outgrown on the way); every draft is the naive search's over the tokens as they are, a request
    not drafted for in a step is dropped at its samples (``receive``), and a new request under a
    reused id starts over."""
    rng = random.Random(0)
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3))
    prompt = [rng.randrange(4) for _ in range(10)]
    request = Request(7, prompt, SamplingParams(max_tokens=400), BLOCK_SIZE)
    for _ in range(300):
        assert proposer.draft(request, 3) == naive_ngram(prompt + request.output_token_ids, 1, 3, 3)
        proposer.receive(ModelRunnerOutput([], [], []))
        for _ in range(rng.randint(1, 4)):  # a verification's accepted tokens
            request.append_output_token(rng.randrange(4), 0.0)
    assert len(proposer._tokens[7].array) < 4 * request.num_tokens
    # Not drafted for in a step: forgotten at its samples.
    proposer.receive(ModelRunnerOutput([], [], []))
    assert proposer._tokens == {}
    again = Request(7, [3, 1, 2, 3, 1], SamplingParams(max_tokens=4), BLOCK_SIZE)
    assert proposer.draft(request, 2) == naive_ngram(prompt + request.output_token_ids, 1, 3, 2)
    assert proposer.draft(again, 2) == [2, 3]


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


# --- asynchronous scheduling: drafts in flight counted as accepted ---------------------------


def make_async_scheduler(k: int = 3) -> Scheduler:
    """A scheduler whose drafts come from the worker (a draft model), stepped as the core steps
    with asynchronous scheduling: step N + 1 scheduled before step N's output is applied."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    spec = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=k)
    scheduler = Scheduler(config, BLOCK_SIZE, 32, 0, speculative_config=spec)
    scheduler.kv_cache_manager.watermark_blocks = 0
    return scheduler


def verified(req_id: int, tokens: list[int], num_accepted: int, drafts: list[int]) -> ModelRunnerOutput:
    """A verification's output: the accepted drafts and one token more, and the next drafts."""
    return ModelRunnerOutput(
        [req_id] * len(tokens),
        tokens,
        [0.0] * len(tokens),
        num_accepted_tokens={req_id: num_accepted},
        draft_token_ids={req_id: drafts},
    )


def test_a_step_scheduled_over_drafts_in_flight_is_corrected_when_their_output_arrives():
    scheduler = make_async_scheduler()
    kv = scheduler.kv_cache_manager
    request = add(scheduler, list(range(1, 14)))  # 13 prompt tokens, positions 0 .. 12
    rid = request.req_id
    prefill = scheduler.schedule()
    # Step 1, scheduled before the prefill's sample is seen: its newest token and 3 placeholders
    # for the drafts the worker will propose after that sample (positions 13 .. 16).
    step1 = scheduler.schedule()
    assert step1.scheduled_spec_decode_tokens == {rid: [DRAFT_PLACEHOLDER] * 3}
    assert step1.num_scheduled_tokens == {rid: 4} and not step1.optimistic_req_ids
    scheduler.update_from_output(
        prefill, ModelRunnerOutput([rid], [50], [0.0], draft_token_ids={rid: [6, 7, 8]})
    )
    # Step 2, scheduled while step 1 runs: its 3 drafts counted as accepted, so its tokens
    # start at position 17 (13 + 4) and reach 20; 21 tokens hold 6 blocks of 4.
    step2 = scheduler.schedule()
    assert step2.optimistic_req_ids == {rid}
    assert step2.scheduled_cached_reqs.num_computed_tokens == [17]
    assert request.num_computed_tokens == 21
    assert request.num_output_placeholders == 1 + 3 + 1 + 3  # step 1's four, step 2's four
    assert len(kv.get_block_ids(request)) == 6
    # Step 1 accepted one draft of three: 2 tokens; step 2 really computes positions 15 .. 18.
    scheduler.update_from_output(step1, verified(rid, [6, 51], 1, [9, 9, 9]))
    assert request.output_token_ids == [50, 6, 51]
    assert request.num_computed_tokens == 19 and request.num_output_placeholders == 4
    assert len(kv.get_block_ids(request)) == 5  # the block only positions 20 .. 23 reached: free
    # Step 2 accepts all 3: the request's 20 tokens are computed but its newest.
    scheduler.update_from_output(step2, verified(rid, [9, 9, 9, 52], 3, [1, 2, 3]))
    assert request.output_token_ids == [50, 6, 51, 9, 9, 9, 52]
    assert request.num_computed_tokens == 19 and request.num_output_placeholders == 0
    assert scheduler.spec_decoding.num_draft_tokens == 6
    assert scheduler.spec_decoding.num_accepted_tokens == 4


def test_near_max_tokens_the_next_drafts_wait_for_the_acceptance_in_flight():
    scheduler = make_async_scheduler()
    request = add(scheduler, list(range(1, 14)), max_tokens=7)
    rid = request.req_id
    prefill = scheduler.schedule()
    step1 = scheduler.schedule()  # 3 placeholders: 1 + 3 + 1 of 7 outputs at most
    assert step1.scheduled_spec_decode_tokens == {rid: [DRAFT_PLACEHOLDER] * 3}
    scheduler.update_from_output(
        prefill, ModelRunnerOutput([rid], [50], [0.0], draft_token_ids={rid: [6, 7, 8]})
    )
    # Counting step 1's drafts as accepted, 5 outputs: the next step could draft only 1 (7 - 5 -
    # 1), where 0 to 3 accepted would allow 3 down to 1. The core applies step 1 first.
    assert scheduler.spec_decoding.waits_for_acceptance(request)
    assert scheduler.has_requests_needing_host()
    scheduler.update_from_output(step1, verified(rid, [51], 0, [9, 9, 9]))
    assert not scheduler.has_requests_needing_host()
    step2 = scheduler.schedule()  # 2 outputs, exactly: 3 drafts fit
    assert step2.scheduled_spec_decode_tokens == {rid: [DRAFT_PLACEHOLDER] * 3}
    assert not step2.optimistic_req_ids
