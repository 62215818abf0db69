"""RequestGroup: what a user request's sequences share, set once when its first sequence is made."""

from pagedllm.core.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams


def first_sequence(eos_token_ids: tuple[int, ...] = (2,), **params) -> Request:
    return Request(0, [1, 2, 3], SamplingParams(**params), 4, 5.0, "user-7", eos_token_ids)


def test_the_first_sequence_makes_its_group_and_is_its_only_member():
    request = first_sequence()
    group = request.group
    assert group.members == [request]
    assert group.request_id == "user-7" and group.arrival_time == 5.0
    assert group.sampling_params is request.sampling_params
    assert group.eos_token_ids == {2}
    assert first_sequence(ignore_eos=True).group.eos_token_ids == frozenset()


def test_what_the_workers_need_to_sample_is_set_at_add():
    # min_tokens bans EOS and the stop ids until it is reached; without min_tokens nothing.
    assert first_sequence(min_tokens=3, stop_token_ids=[9, 4]).group.min_tokens_stop_ids == [2, 4, 9]
    assert first_sequence(min_tokens=3, stop_token_ids=[9], ignore_eos=True).group.min_tokens_stop_ids == [9]
    assert first_sequence(stop_token_ids=[9]).group.min_tokens_stop_ids == []
    # Top tokens: the logprobs asked for; beam search offers 2B candidates per beam with one EOS
    # id, (1 + #EOS) * B with more.
    assert first_sequence(logprobs=3).group.num_top_tokens == 3
    assert first_sequence().group.num_top_tokens == 0
    beams = {"use_beam_search": True, "best_of": 3, "temperature": 0.0}
    assert first_sequence(**beams).group.num_top_tokens == 6
    assert first_sequence((2, 5, 8), **beams).group.num_top_tokens == 12
    assert first_sequence(**beams, logprobs=7).group.num_top_tokens == 7


def test_a_group_holds_best_of_rows_until_it_forks_then_its_live_members():
    request = first_sequence(n=2, best_of=3, temperature=1.0)
    request.num_samples = 3  # as the scheduler admits it: it draws best_of first tokens
    group = request.group
    assert group.max_running_seqs == 3
    request.num_samples = 1
    group.members += [request.fork(1), request.fork(2)]
    assert group.max_running_seqs == 3
    group.members[2].status = RequestStatus.SWAPPED
    assert group.members_in(RequestStatus.SWAPPED) == [group.members[2]]
    group.members.pop()
    assert group.max_running_seqs == 2
    beams = first_sequence(use_beam_search=True, best_of=4, temperature=0.0)
    assert beams.group.max_running_seqs == 4


def test_siblings_get_distinct_seeds_and_the_first_keeps_the_users():
    request = first_sequence(n=3, temperature=1.0, seed=11)
    forks = [request.fork(i) for i in (1, 2)]
    for index, fork in enumerate(forks, start=1):
        fork.output_index = index
    seeds = [request.seed] + [fork.seed for fork in forks]
    assert seeds[0] == 11 and len(set(seeds)) == 3
    assert first_sequence(temperature=1.0).seed is None
