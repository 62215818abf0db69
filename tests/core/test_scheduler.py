"""Scheduler policy: FCFS admission, budgets, chunked prefill, preemption by RECOMPUTE and SWAP.

The model is not run: ``step`` below plays the engine's part after each schedule (count computed
tokens, append a token when a sequence reaches its end, fork best_of > 1 requests, finish at
max_tokens).
"""

import itertools

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.scheduler import PreemptionMode, Scheduler, SchedulerOutputs
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

BLOCK_SIZE = 4
_ids = itertools.count()


def make_scheduler(
    num_gpu_blocks: int,
    num_cpu_blocks: int = 0,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    chunked: bool = False,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
    )
    scheduler = Scheduler(config, BLOCK_SIZE, num_gpu_blocks, num_cpu_blocks)
    scheduler.block_manager.watermark_blocks = 0
    return scheduler


def add(
    scheduler: Scheduler, prompt_len: int, max_tokens: int = 8, best_of: int = 1, t: float = 0.0
) -> SequenceGroup:
    seq = Sequence(next(_ids), list(range(1, prompt_len + 1)), BLOCK_SIZE)
    params = SamplingParams(n=best_of, max_tokens=max_tokens, temperature=1.0 if best_of > 1 else 0.0)
    group = SequenceGroup(f"r{seq.seq_id}", [seq], params, arrival_time=t or float(seq.seq_id))
    scheduler.add_seq_group(group)
    return group


def step(scheduler: Scheduler) -> SchedulerOutputs:
    out = scheduler.schedule()
    for scheduled in out.scheduled_seq_groups:
        group = scheduled.seq_group
        done = []
        for seq in group.seqs:
            seq.num_computed_tokens += scheduled.num_new_tokens.get(seq.seq_id, 0)
            if seq.seq_id in scheduled.num_new_tokens and seq.num_computed_tokens == seq.get_len():
                done.append(seq)
        if done and not group.is_forked:
            for _ in range(group.sampling_params.best_of - 1):
                child = done[0].fork(next(_ids))
                scheduler.fork_seq(done[0], child)
                group.add(child)
                done.append(child)
        for seq in done:
            seq.append_token_id(1000 + seq.seq_id, 0.0)
            if seq.num_output_tokens >= group.sampling_params.max_tokens:
                seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                scheduler.free_seq(seq)
    scheduler.free_finished_seq_groups()
    return out


def scheduled_ids(out: SchedulerOutputs) -> list[str]:
    return [s.seq_group.request_id for s in out.scheduled_seq_groups]


def run_to_completion(scheduler: Scheduler, max_steps: int = 500) -> list[SchedulerOutputs]:
    outs = []
    while scheduler.has_unfinished_seqs():
        outs.append(step(scheduler))
        assert len(outs) < max_steps, "the scheduler made no progress"
    bm = scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    return outs


def test_fcfs_admission_respects_max_num_seqs():
    scheduler = make_scheduler(num_gpu_blocks=64, max_num_seqs=2)
    a, b, c = (add(scheduler, 5, max_tokens=2) for _ in range(3))
    out = step(scheduler)
    assert scheduled_ids(out) == [a.request_id, b.request_id]
    assert [s.num_new_tokens for s in out.scheduled_seq_groups] == [
        {a.seqs[0].seq_id: 5},
        {b.seqs[0].seq_id: 5},
    ]
    out = step(scheduler)  # a and b decode and finish; c still waits for a seat
    assert scheduled_ids(out) == [a.request_id, b.request_id]
    assert scheduled_ids(step(scheduler)) == [c.request_id]
    run_to_completion(scheduler)


def test_token_budget_makes_prompts_wait():
    scheduler = make_scheduler(num_gpu_blocks=64, max_num_batched_tokens=16, max_model_len=16)
    a, b = add(scheduler, 10), add(scheduler, 10)
    out = step(scheduler)
    assert scheduled_ids(out) == [a.request_id] and out.num_batched_tokens == 10
    out = step(scheduler)  # a decodes (1 token), b's 10-token prompt fits beside it
    assert scheduled_ids(out) == [a.request_id, b.request_id] and out.num_batched_tokens == 11
    run_to_completion(scheduler)


def test_chunked_prefill_splits_a_long_prompt_and_decodes_go_first():
    scheduler = make_scheduler(
        num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64, chunked=True
    )
    short = add(scheduler, 3, max_tokens=20)
    step(scheduler)  # short's prompt
    long = add(scheduler, 20, max_tokens=2)
    chunks = []
    for _ in range(3):
        out = step(scheduler)
        assert scheduled_ids(out)[0] == short.request_id, "the running decode is never skipped"
        assert out.scheduled_seq_groups[0].num_new_tokens == {short.seqs[0].seq_id: 1}
        chunks.append(out.scheduled_seq_groups[1].num_new_tokens[long.seqs[0].seq_id])
        assert out.num_batched_tokens <= 8
    assert chunks == [7, 7, 6]
    assert long.seqs[0].num_output_tokens == 1
    run_to_completion(scheduler)


def test_recompute_preemption_of_a_single_sequence_request():
    # 6 blocks of 4: two requests of 8 tokens take 4 blocks; growth needs more than are left.
    scheduler = make_scheduler(num_gpu_blocks=6)
    a, b = add(scheduler, 8, max_tokens=12), add(scheduler, 8, max_tokens=12)
    preempted = {}
    for out in run_to_completion(scheduler):
        preempted.update(out.preempted)
    # The later request is the victim, by recompute: it has one sequence.
    assert preempted == {b.request_id: PreemptionMode.RECOMPUTE}
    assert scheduler.num_preemptions[PreemptionMode.RECOMPUTE] >= 1
    for group in (a, b):
        assert group.seqs[0].num_output_tokens == 12


def test_recompute_resets_progress_and_requeues_at_the_front():
    scheduler = make_scheduler(num_gpu_blocks=6)
    add(scheduler, 8, max_tokens=12)
    b = add(scheduler, 8, max_tokens=12)
    out = step(scheduler)
    while not out.preempted:
        out = step(scheduler)
    assert b.request_id in out.preempted
    assert scheduler.waiting[0] is b
    assert b.seqs[0].num_computed_tokens == 0 and b.seqs[0].status == SequenceStatus.WAITING
    assert b.seqs[0].seq_id not in scheduler.block_manager.block_tables


def test_swap_preemption_of_a_multi_sequence_request_and_swap_in_before_admission():
    scheduler = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=16)
    a = add(scheduler, 8, max_tokens=12)
    b = add(scheduler, 3, max_tokens=8, best_of=2)
    modes = {}
    admitted_while_swapped = False
    c = None
    for _ in range(200):
        if not scheduler.has_unfinished_seqs():
            break
        if scheduler.swapped and c is None:
            c = add(scheduler, 3, max_tokens=2)
        out = step(scheduler)
        modes.update(out.preempted)
        if scheduler.swapped and c is not None and c.seqs[0].status != SequenceStatus.WAITING:
            admitted_while_swapped = True
    assert modes.get(b.request_id) == PreemptionMode.SWAP
    assert c is not None and not admitted_while_swapped
    assert scheduler.num_preemptions[PreemptionMode.SWAP] >= 1
    assert all(seq.num_output_tokens == 8 for seq in b.seqs) and len(b.seqs) == 2
    assert a.seqs[0].num_output_tokens == 12
    bm = scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == 8 and bm.get_num_free_cpu_blocks() == 16


def test_swap_falls_back_to_recompute_without_cpu_space():
    scheduler = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=0)
    add(scheduler, 8, max_tokens=12)
    b = add(scheduler, 3, max_tokens=8, best_of=2)
    modes = {}
    for out in run_to_completion(scheduler):
        modes.update(out.preempted)
    assert modes.get(b.request_id) == PreemptionMode.RECOMPUTE
    assert all(seq.num_output_tokens == 8 for seq in b.seqs)


def test_a_request_larger_than_the_cache_is_ignored_and_others_go_on():
    scheduler = make_scheduler(num_gpu_blocks=4)
    big = add(scheduler, 20)
    ok = add(scheduler, 4, max_tokens=2)
    out = step(scheduler)
    assert out.ignored_seq_groups == [big]
    assert big.seqs[0].status == SequenceStatus.FINISHED_IGNORED and "KV cache blocks" in big.error
    assert scheduled_ids(out) == [ok.request_id]
    run_to_completion(scheduler)


def test_abort_frees_blocks_in_every_queue():
    scheduler = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=16, max_num_seqs=4)
    groups = [
        add(scheduler, 6, max_tokens=30),
        add(scheduler, 3, max_tokens=30, best_of=2),
        add(scheduler, 5),
    ]
    for _ in range(6):
        step(scheduler)
    aborted = scheduler.abort_seq_group({g.request_id for g in groups})
    assert {g.request_id for g in aborted} == {g.request_id for g in groups}
    assert all(
        seq.status == SequenceStatus.FINISHED_ABORTED
        for g in groups
        for seq in g.seqs
        if seq.num_output_tokens < 30
    )
    assert not scheduler.has_unfinished_seqs()
    bm = scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == 8 and bm.get_num_free_cpu_blocks() == 16 and not bm.block_tables


@pytest.mark.parametrize("chunked", [False, True])
def test_many_requests_complete_under_memory_pressure(chunked):
    scheduler = make_scheduler(
        num_gpu_blocks=12, num_cpu_blocks=12, max_num_batched_tokens=16, max_model_len=16, chunked=chunked
    )
    groups = [
        add(scheduler, 1 + (i * 5) % 9, max_tokens=1 + (i * 3) % 7, best_of=1 + i % 2) for i in range(12)
    ]
    run_to_completion(scheduler)
    for group in groups:
        assert all(seq.num_output_tokens == group.sampling_params.max_tokens for seq in group.seqs)


def test_a_request_that_outgrows_the_whole_cache_stops_with_its_outputs_and_frees_the_rest():
    # Two sequences sharing a 12-token prompt grow past the 6 blocks (24 tokens) of the cache.
    scheduler = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=16)
    big = add(scheduler, 12, max_tokens=30, best_of=2)
    small = None
    ignored = []
    for _ in range(100):
        if not scheduler.has_unfinished_seqs():
            break
        out = step(scheduler)
        ignored += out.ignored_seq_groups
        if ignored and small is None:
            small = add(scheduler, 4, max_tokens=3)
    assert ignored == [big] and "more KV cache blocks than the cache has" in big.error
    assert all(
        seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED and seq.num_output_tokens > 0 for seq in big.seqs
    )
    assert small is not None and small.seqs[0].num_output_tokens == 3
    bm = scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == 6 and bm.get_num_free_cpu_blocks() == 16
