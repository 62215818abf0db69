"""The isolation policy: which requests may run while suspects of a failed step are tested."""

from pagedllm.core.isolation import IsolationPolicy
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


def group_of(first_id: int, size: int) -> list[Request]:
    """A user request's sequences: ids first_id, first_id + 1, ..."""
    first = Request(first_id, [1, 2], SamplingParams(n=size, temperature=1.0), 4, float(first_id))
    members = [first] + [first.fork(first_id + i) for i in range(1, size)]
    first.group.members[:] = members
    return members


def test_without_failures_everything_is_admitted_and_nothing_is_a_victim():
    policy = IsolationPolicy()
    a = group_of(0, 1)
    assert not policy.active and policy.probe() is None
    assert policy.admits(a[0])
    assert policy.victim_outside_probe(a) is None


def test_a_failure_of_several_groups_splits_them_into_two_probes_run_one_at_a_time():
    policy = IsolationPolicy()
    a, b, c = group_of(0, 2), group_of(10, 1), group_of(20, 1)
    assert policy.after_failure(a + b + c) is None
    assert policy.active
    assert policy.probe() == {0, 1}  # the first half: a's sequences
    assert policy.admits(a[1]) and not policy.admits(b[0])
    # Room for the probe comes from the lowest-priority running group outside it.
    running = a + b + c
    assert policy.victim_outside_probe(running) is c[0]
    assert policy.victim_outside_probe(a) is None
    policy.sampled([0])
    assert policy.probe() == {0, 1}, "a probe ends once each of its requests sampled"
    policy.sampled([1])
    assert policy.probe() == {10, 20}
    policy.discard(10)
    policy.sampled([20])
    assert not policy.active


def test_a_failure_inside_a_probe_of_one_group_convicts_it():
    policy = IsolationPolicy()
    a, b = group_of(0, 2), group_of(10, 1)
    assert policy.after_failure(a + b) is None
    assert policy.after_failure(a) is a[0].group
    assert policy.probe() == {10}, "b is still tested"


def test_a_single_suspect_group_outside_any_probe_is_tested_alone_first():
    policy = IsolationPolicy()
    a = group_of(0, 1)
    assert policy.after_failure(a) is None, "a first failure never convicts"
    assert policy.probe() == {0}
    assert policy.after_failure(a) is a[0].group
    assert not policy.active
