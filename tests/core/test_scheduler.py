"""Scheduler policy: FCFS admission, budgets, chunked prefill, preemption by RECOMPUTE and SWAP,
isolation of a request that fails the model step.

The model is not run: ``step`` below schedules, then feeds ``update_from_output`` a sample for
every request the step completes (token 1000 + its id); the scheduler ends each request at
max_tokens itself.
"""

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import PreemptionMode, Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.step_io import ModelRunnerOutput, SchedulerOutput

BLOCK_SIZE = 4


class Group:
    """One user request: its sequences (forks included), named by its first sequence's id."""

    def __init__(self, first: Request) -> None:
        self.seqs = [first]
        self.request_id = first.req_id
        self.sampling_params = first.sampling_params
        self.error: str | None = None


class Harness:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.group_of: dict[int, Group] = {}
        # Per step: the groups preempted (and how) and the groups the scheduler ended.
        self.preempted: dict[int, PreemptionMode] = {}
        self.ignored: list[Group] = []


def make_scheduler(
    num_gpu_blocks: int,
    num_cpu_blocks: int = 0,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    chunked: bool = False,
) -> Harness:
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
    )
    scheduler = Scheduler(config, BLOCK_SIZE, num_gpu_blocks, num_cpu_blocks)
    scheduler.kv_cache_manager.watermark_blocks = 0
    return Harness(scheduler)


def add(h: Harness, prompt_len: int, max_tokens: int = 8, best_of: int = 1, t: float = 0.0) -> Group:
    req_id = h.scheduler.new_req_id()
    params = SamplingParams(n=best_of, max_tokens=max_tokens, temperature=1.0 if best_of > 1 else 0.0)
    request = Request(req_id, list(range(1, prompt_len + 1)), params, BLOCK_SIZE, t or float(req_id))
    group = h.group_of[req_id] = Group(request)
    h.scheduler.add_request(request)
    return group


def step(h: Harness) -> SchedulerOutput:
    return apply(h, schedule(h))


def schedule(h: Harness) -> SchedulerOutput:
    scheduler = h.scheduler
    out = scheduler.schedule()
    h.preempted = {h.group_of[r].request_id: mode for r, mode in scheduler.last_preemptions.items()}
    h.ignored = [h.group_of[r.req_id] for r in scheduler.queues.stopped]
    take_stopped(h)
    return out


def take_stopped(h: Harness) -> None:
    for request in h.scheduler.queues.stopped:
        h.group_of[request.req_id].error = request.error
    h.scheduler.queues.stopped.clear()


def apply(h: Harness, out: SchedulerOutput) -> SchedulerOutput:
    """Sample for every request of ``out`` that reaches its end, as a worker would."""
    scheduler = h.scheduler
    runner_output = ModelRunnerOutput()
    for req_id in out.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        if request.num_output_placeholders:  # the step reaches its end: it samples
            for _ in range(request.num_samples):
                runner_output.req_ids.append(req_id)
                runner_output.sampled_token_ids.append(1000 + req_id)
                runner_output.logprobs.append(0.0)
    sampled = scheduler.update_from_output(out, runner_output)
    for parent, child in sampled.forked:
        group = h.group_of[child.req_id] = h.group_of[parent.req_id]
        group.seqs.append(child)
    return out


def scheduled_ids(h: Harness, out: SchedulerOutput) -> list[int]:
    ids = [h.group_of[r].request_id for r in out.num_scheduled_tokens]
    return list(dict.fromkeys(ids))


def run_to_completion(h: Harness, max_steps: int = 500) -> list[dict[int, PreemptionMode]]:
    """Step until every request ends; returns each step's preemptions."""
    preemptions = []
    while h.scheduler.has_unfinished_requests():
        step(h)
        preemptions.append(h.preempted)
        assert len(preemptions) < max_steps, "the scheduler made no progress"
    bm = h.scheduler.kv_cache_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    return preemptions


def test_fcfs_admission_respects_max_num_seqs():
    h = make_scheduler(num_gpu_blocks=64, max_num_seqs=2)
    a, b, c = (add(h, 5, max_tokens=2) for _ in range(3))
    out = step(h)
    assert scheduled_ids(h, out) == [a.request_id, b.request_id]
    assert out.num_scheduled_tokens == {a.seqs[0].req_id: 5, b.seqs[0].req_id: 5}
    out = step(h)  # a and b decode and finish; c still waits for a seat
    assert scheduled_ids(h, out) == [a.request_id, b.request_id]
    assert scheduled_ids(h, step(h)) == [c.request_id]
    run_to_completion(h)


def test_token_budget_makes_prompts_wait():
    h = make_scheduler(num_gpu_blocks=64, max_num_batched_tokens=16, max_model_len=16)
    a, b = add(h, 10), add(h, 10)
    out = step(h)
    assert scheduled_ids(h, out) == [a.request_id] and out.total_num_scheduled_tokens == 10
    out = step(h)  # a decodes (1 token), b's 10-token prompt fits beside it
    assert scheduled_ids(h, out) == [a.request_id, b.request_id] and out.total_num_scheduled_tokens == 11
    run_to_completion(h)


def test_chunked_prefill_splits_a_long_prompt_and_decodes_go_first():
    h = make_scheduler(
        num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64, chunked=True
    )
    short = add(h, 3, max_tokens=20)
    step(h)  # short's prompt
    long = add(h, 20, max_tokens=2)
    chunks = []
    for _ in range(3):
        out = step(h)
        assert scheduled_ids(h, out)[0] == short.request_id, "the running decode is never skipped"
        assert next(iter(out.num_scheduled_tokens.items())) == (short.seqs[0].req_id, 1)
        chunks.append(out.num_scheduled_tokens[long.seqs[0].req_id])
        assert out.total_num_scheduled_tokens <= 8
    assert chunks == [7, 7, 6]
    assert long.seqs[0].num_output_tokens == 1
    run_to_completion(h)


def test_recompute_preemption_of_a_single_sequence_request():
    # 6 blocks of 4: two requests of 8 tokens take 4 blocks; growth needs more than are left.
    h = make_scheduler(num_gpu_blocks=6)
    a, b = add(h, 8, max_tokens=12), add(h, 8, max_tokens=12)
    preempted = {}
    for step_preemptions in run_to_completion(h):
        preempted.update(step_preemptions)
    # The later request is the victim, by recompute: it has one sequence.
    assert preempted == {b.request_id: PreemptionMode.RECOMPUTE}
    assert h.scheduler.num_preemptions[PreemptionMode.RECOMPUTE] >= 1
    for group in (a, b):
        assert group.seqs[0].num_output_tokens == 12


def test_recompute_resets_progress_and_requeues_at_the_front():
    h = make_scheduler(num_gpu_blocks=6)
    add(h, 8, max_tokens=12)
    b = add(h, 8, max_tokens=12)
    step(h)
    while not h.preempted:
        step(h)
    assert b.request_id in h.preempted
    assert h.scheduler.waiting[0] is b.seqs[0]
    assert b.seqs[0].num_computed_tokens == 0 and b.seqs[0].status == RequestStatus.WAITING
    assert h.scheduler.kv_cache_manager.get_num_requests_with_blocks() == 1, "only a holds blocks"


def test_swap_preemption_of_a_multi_sequence_request_and_swap_in_before_admission():
    h = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=16)
    scheduler = h.scheduler
    a = add(h, 8, max_tokens=12)
    b = add(h, 3, max_tokens=8, best_of=2)
    modes = {}
    admitted_while_swapped = False
    c = None
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        if scheduler.queues.swapped and c is None:
            c = add(h, 3, max_tokens=2)
        step(h)
        modes.update(h.preempted)
        if scheduler.queues.swapped and c is not None and c.seqs[0].status != RequestStatus.WAITING:
            admitted_while_swapped = True
    assert modes.get(b.request_id) == PreemptionMode.SWAP
    assert c is not None and not admitted_while_swapped
    assert scheduler.num_preemptions[PreemptionMode.SWAP] >= 1
    assert all(seq.num_output_tokens == 8 for seq in b.seqs) and len(b.seqs) == 2
    assert a.seqs[0].num_output_tokens == 12
    bm = scheduler.kv_cache_manager
    assert bm.get_num_free_gpu_blocks() == 8 and bm.get_num_free_cpu_blocks() == 16


def test_swap_falls_back_to_recompute_without_cpu_space():
    h = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=0)
    add(h, 8, max_tokens=12)
    b = add(h, 3, max_tokens=8, best_of=2)
    modes = {}
    for step_preemptions in run_to_completion(h):
        modes.update(step_preemptions)
    assert modes.get(b.request_id) == PreemptionMode.RECOMPUTE
    assert all(seq.num_output_tokens == 8 for seq in b.seqs)


def test_a_request_larger_than_the_cache_is_ignored_and_others_go_on():
    h = make_scheduler(num_gpu_blocks=4)
    big = add(h, 20)
    ok = add(h, 4, max_tokens=2)
    out = step(h)
    assert h.ignored == [big]
    assert big.seqs[0].status == RequestStatus.FINISHED_IGNORED and "KV cache blocks" in big.error
    assert scheduled_ids(h, out) == [ok.request_id]
    run_to_completion(h)


def test_abort_frees_blocks_in_every_queue():
    h = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=16, max_num_seqs=4)
    scheduler = h.scheduler
    groups = [
        add(h, 6, max_tokens=30),
        add(h, 3, max_tokens=30, best_of=2),
        add(h, 5),
    ]
    for _ in range(6):
        step(h)
    live = [seq for g in groups for seq in g.seqs if not seq.is_finished]
    assert {seq.status for seq in live} >= {RequestStatus.RUNNING}
    scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
    assert all(
        seq.status == RequestStatus.FINISHED_ABORTED
        for g in groups
        for seq in g.seqs
        if seq.num_output_tokens < 30
    )
    assert not scheduler.has_unfinished_requests()
    assert not scheduler.waiting and not scheduler.running and not scheduler.queues.swapped
    bm = scheduler.kv_cache_manager
    assert bm.get_num_free_gpu_blocks() == 8 and bm.get_num_free_cpu_blocks() == 16
    assert bm.get_num_requests_with_blocks() == 0


@pytest.mark.parametrize("chunked", [False, True])
def test_many_requests_complete_under_memory_pressure(chunked):
    h = make_scheduler(
        num_gpu_blocks=12, num_cpu_blocks=12, max_num_batched_tokens=16, max_model_len=16, chunked=chunked
    )
    groups = [add(h, 1 + (i * 5) % 9, max_tokens=1 + (i * 3) % 7, best_of=1 + i % 2) for i in range(12)]
    run_to_completion(h)
    for group in groups:
        assert all(seq.num_output_tokens == group.sampling_params.max_tokens for seq in group.seqs)


def test_a_request_that_outgrows_the_whole_cache_stops_with_its_outputs_and_frees_the_rest():
    # Two sequences sharing a 12-token prompt grow past the 6 blocks (24 tokens) of the cache.
    h = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=16)
    scheduler = h.scheduler
    big = add(h, 12, max_tokens=30, best_of=2)
    small = None
    ignored = []
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        step(h)
        ignored += h.ignored
        if ignored and small is None:
            small = add(h, 4, max_tokens=3)
    assert set(map(id, ignored)) == {id(big)} and "more KV cache blocks than the cache has" in big.error
    assert all(
        seq.status == RequestStatus.FINISHED_LENGTH_CAPPED and seq.num_output_tokens > 0 for seq in big.seqs
    )
    assert small is not None and small.seqs[0].num_output_tokens == 3
    bm = scheduler.kv_cache_manager
    assert bm.get_num_free_gpu_blocks() == 6 and bm.get_num_free_cpu_blocks() == 16


def sample_all(h: Harness, out: SchedulerOutput, token: int) -> ModelRunnerOutput:
    """A runner output giving ``token`` to every request of ``out`` that samples."""
    req_ids = [r for r, n in out.num_scheduled_tokens.items() if h.scheduler.requests.get(r) is not None]
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=[token] * len(req_ids), logprobs=[0.0] * len(req_ids)
    )


def test_async_steps_schedule_placeholders_and_drop_samples_after_a_stop():
    """Step N + 1 is scheduled before step N's samples arrive (asynchronous scheduling)."""
    h = make_scheduler(num_gpu_blocks=64)
    scheduler = h.scheduler
    a, b = add(h, 5, max_tokens=3), add(h, 3, max_tokens=3)
    ra, rb = a.seqs[0], b.seqs[0]
    first = scheduler.schedule()  # both prompts; each will sample
    assert first.num_scheduled_tokens == {ra.req_id: 5, rb.req_id: 3}
    assert (ra.num_computed_tokens, ra.num_output_placeholders) == (5, 1)
    second = scheduler.schedule()  # before the first samples: each decodes its placeholder
    assert second.num_scheduled_tokens == {ra.req_id: 1, rb.req_id: 1}
    assert not second.scheduled_new_reqs and second.scheduled_cached_reqs.num_computed_tokens == [5, 3]
    assert (ra.num_computed_tokens, ra.num_output_placeholders) == (6, 2)
    scheduler.update_from_output(first, sample_all(h, first, 7))
    assert ra.output_token_ids == [7] and ra.num_output_placeholders == 1
    # b stops on its first token (as the engine's stop check would decide); its second sample,
    # computed meanwhile, must be dropped.
    scheduler.finish_requests((rb,), RequestStatus.FINISHED_STOPPED)
    third = scheduler.schedule()
    assert rb.req_id in third.finished_req_ids and set(third.num_scheduled_tokens) == {ra.req_id}
    result = scheduler.update_from_output(second, sample_all(h, second, 8))
    assert [r.req_id for r, _ in result.appended] == [ra.req_id]
    assert rb.output_token_ids == [7] and ra.output_token_ids == [7, 8]
    scheduler.update_from_output(third, sample_all(h, third, 9))
    assert ra.output_token_ids == [7, 8, 9] and ra.num_output_placeholders == 0
    assert ra.num_computed_tokens == ra.num_tokens - 1
    assert ra.status == RequestStatus.FINISHED_LENGTH_CAPPED, "the scheduler ends it at max_tokens"
    assert scheduler.kv_cache_manager.get_num_free_gpu_blocks() == 64


def test_update_from_output_ends_a_request_on_eos_and_drops_its_sample_in_flight():
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    scheduler = Scheduler(config, BLOCK_SIZE, 16, 0)
    eos, stop = 2, 9
    a, b, c = (
        Request(i, [1, 3, 4], SamplingParams(max_tokens=10, **kw), BLOCK_SIZE, float(i), eos_token_ids=[eos])
        for i, kw in enumerate([{}, {"stop_token_ids": [stop]}, {"ignore_eos": True, "min_tokens": 1}])
    )
    for request in (a, b, c):
        scheduler.add_request(request)
    first = scheduler.schedule()
    second = scheduler.schedule()  # launched before the first's samples arrive
    outputs = ModelRunnerOutput(req_ids=[0, 1, 2], sampled_token_ids=[eos, stop, eos], logprobs=[0.0] * 3)
    result = scheduler.update_from_output(first, outputs)
    assert [r.req_id for r, _ in result.appended] == [0, 1, 2], "every token is returned, stopping or not"
    assert a.status == b.status == RequestStatus.FINISHED_STOPPED
    assert (a.stop_reason, b.stop_reason) == (None, stop)
    assert c.status == RequestStatus.RUNNING and c.output_token_ids == [eos]
    assert scheduler.kv_cache_manager.get_num_requests_with_blocks() == 1
    outputs = ModelRunnerOutput(req_ids=[0, 1, 2], sampled_token_ids=[5, 5, 5], logprobs=[0.0] * 3)
    result = scheduler.update_from_output(second, outputs)
    assert [r.req_id for r, _ in result.appended] == [2]
    assert a.output_token_ids == [eos] and b.output_token_ids == [stop] and c.output_token_ids == [eos, 5]
    assert scheduler.schedule().finished_req_ids == {0, 1}


def test_a_request_preempted_with_a_sample_in_flight_waits_for_it():
    h = make_scheduler(num_gpu_blocks=64)
    scheduler = h.scheduler
    a = add(h, 6, max_tokens=5)
    ra = a.seqs[0]
    first = scheduler.schedule()
    # Preempt by recompute by hand while its first sample is in flight.
    scheduler._preempt(ra, first, [], [])
    assert ra.status == RequestStatus.WAITING and ra.num_computed_tokens == 0
    assert scheduler.schedule().num_scheduled_tokens == {}, "it waits for its sample"
    scheduler.update_from_output(first, sample_all(h, first, 5))
    resumed = scheduler.schedule()
    assert resumed.num_scheduled_tokens == {ra.req_id: 7}  # prompt + its sample, recomputed
    (new,) = resumed.scheduled_new_reqs
    assert new.output_token_ids == [5] and new.num_computed_tokens == 0


# --- isolation of a request that fails the model step -------------------------------------


def probe_ids(h: Harness) -> set[int]:
    """The user requests of the running probe (empty when not isolating)."""
    running = h.scheduler.isolation.probe()
    return {h.group_of[r].request_id for r in running} if running else set()


def test_a_failing_request_is_found_by_probes_that_run_alone():
    h = make_scheduler(num_gpu_blocks=64, max_num_batched_tokens=64)
    scheduler = h.scheduler
    groups = [add(h, 3 + i % 4, max_tokens=6, best_of=1 + (i == 2)) for i in range(8)]
    poison = groups[5]
    failures = []
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        probe = probe_ids(h)
        out = schedule(h)
        ran = set(scheduled_ids(h, out))
        if probe:  # a probe's steps run nothing else
            assert ran <= probe
        if poison.request_id in ran and poison.seqs[0].num_output_tokens >= 2:
            failures.append(ran)
            scheduler.isolate_failure([out], "boom")
            take_stopped(h)
        else:
            apply(h, out)
    else:
        raise AssertionError("the scheduler made no progress")
    assert poison.seqs[0].status == RequestStatus.FINISHED_ERROR and poison.error == "boom"
    assert poison.seqs[0].num_output_tokens == 2
    # The whole batch, then the halves holding it, down to the verdict: it fails alone.
    assert [len(ran) for ran in failures] == [8, 4, 2, 1]
    for group in groups:
        if group is not poison:
            assert group.error is None
            assert all(seq.num_output_tokens == 6 for seq in group.seqs)
    assert len(groups[2].seqs) == 2
    bm = scheduler.kv_cache_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks and not scheduler.is_isolating


def test_a_probe_preempts_requests_outside_it_to_make_room():
    h = make_scheduler(num_gpu_blocks=9)
    scheduler = h.scheduler
    a, b = add(h, 12, max_tokens=8), add(h, 8, max_tokens=8, best_of=2)
    for _ in range(3):
        step(h)
    assert len(b.seqs) == 2 and scheduler.kv_cache_manager.get_num_free_gpu_blocks() == 1
    # A step with only b's sequences in it failed. Recomputed apart, they no longer share their
    # prompt's blocks: 6 blocks where they held 4, so a (not a suspect) must make room.
    failed = SchedulerOutput(num_scheduled_tokens={seq.req_id: 1 for seq in b.seqs})
    scheduler.isolate_failure([failed], "boom")
    assert all(seq.status == RequestStatus.WAITING and seq.num_computed_tokens == 0 for seq in b.seqs)
    assert probe_ids(h) == {b.request_id}
    out = schedule(h)
    assert h.preempted == {a.request_id: PreemptionMode.RECOMPUTE}
    assert set(scheduled_ids(h, out)) == {b.request_id}
    assert {seq.req_id for seq in b.seqs} <= out.preempted_req_ids  # the workers drop their rows
    apply(h, out)
    assert not scheduler.is_isolating  # each sampled: b is cleared, and a comes back
    run_to_completion(h)
    assert a.seqs[0].num_output_tokens == 8 and [s.num_output_tokens for s in b.seqs] == [8, 8]
    assert a.error is None and b.error is None


def test_requests_whose_swap_a_dropped_step_carried_are_recomputed():
    h = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=16)
    scheduler = h.scheduler
    a = add(h, 8, max_tokens=12)
    b = add(h, 3, max_tokens=8, best_of=2)
    for _ in range(100):
        out = schedule(h)
        if out.blocks_to_swap_out:
            break
        apply(h, out)
    assert h.preempted == {b.request_id: PreemptionMode.SWAP}
    # The step that was to copy b's blocks to the CPU failed: b's copy there is worthless.
    scheduler.isolate_failure([out], "boom")
    assert all(seq.status == RequestStatus.WAITING and seq.num_computed_tokens == 0 for seq in b.seqs)
    assert scheduler.kv_cache_manager.get_num_free_cpu_blocks() == 16 and not scheduler.queues.swapped
    assert probe_ids(h) == {a.request_id}  # b did not run in it: it is no suspect
    run_to_completion(h)
    assert a.seqs[0].num_output_tokens == 12 and [s.num_output_tokens for s in b.seqs] == [8, 8]


def test_a_block_is_cached_once_the_step_that_filled_it_is_applied():
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    scheduler = Scheduler(config, BLOCK_SIZE, 16, 0, enable_prefix_caching=True)
    request = Request(0, [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=4), BLOCK_SIZE)
    scheduler.add_request(request)
    allocator = scheduler.kv_cache_manager.gpu_allocator
    first = scheduler.schedule()  # the prompt; samples token 8
    second = scheduler.schedule()  # launched before the first's sample arrives: computes token 8
    runner_output = ModelRunnerOutput(req_ids=[0], sampled_token_ids=[8], logprobs=[0.0])
    scheduler.update_from_output(first, runner_output)
    first_block, second_block = request.update_block_hashes()
    assert allocator.peek(first_block) is not None
    # Tokens 5-8 are known, but token 8's K/V comes from the second step, still in flight.
    assert allocator.peek(second_block) is None
    scheduler.update_from_output(
        second, ModelRunnerOutput(req_ids=[0], sampled_token_ids=[9], logprobs=[0.0])
    )
    assert allocator.peek(second_block) is not None
