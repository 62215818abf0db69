"""Fan-out: best_of forks after the first sample, beam search's forks and frees, hypotheses."""

from pagedllm.core.fanout import FanOut
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import PendingHypothesis, Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


class Harness:
    """A fan-out over a real KV cache manager, recording what it asks of the scheduler."""

    def __init__(self) -> None:
        self.kv = KVCacheManager(BLOCK_SIZE, 16, 0, watermark=0.0)
        self.next_id = 100
        self.running: list[Request] = []
        self.finished: list[tuple[Request, RequestStatus]] = []
        self.fanout = FanOut(self.kv, self.new_req_id, self.running.append, self.finish)

    def new_req_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def finish(self, requests, status: RequestStatus) -> None:
        for request in requests:
            request.status = status
            request.group.members.remove(request)
            self.kv.free(request)
            self.finished.append((request, status))

    def admit(self, params: SamplingParams, prompt_len: int = 6) -> Request:
        request = Request(0, list(range(1, prompt_len + 1)), params, BLOCK_SIZE)
        self.kv.allocate(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = prompt_len
        return request


def test_a_best_of_request_forks_a_sibling_per_extra_first_sample():
    h = Harness()
    request = h.admit(SamplingParams(n=2, best_of=3, temperature=1.0, seed=5))
    request.num_samples = 3
    samplers = h.fanout.fork_first_samples(request)
    assert samplers[0] is request and len(samplers) == 3
    assert [s.req_id for s in samplers] == [0, 101, 102]
    assert [s.output_index for s in samplers] == [0, 1, 2]
    assert [s.num_samples for s in samplers] == [1, 1, 1]
    assert request.group.members == samplers and h.running == samplers[1:]
    assert all(s.group is request.group for s in samplers)
    # The forks share the prompt's blocks: no block was allocated for them.
    assert all(h.kv.get_block_ids(s) == h.kv.get_block_ids(request) for s in samplers)
    assert h.kv.get_num_free_gpu_blocks() == 16 - 2
    assert len({s.seed for s in samplers}) == 3


def test_a_beam_kept_twice_forks_and_one_kept_by_none_is_freed():
    h = Harness()
    params = SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0.0)
    a = h.admit(params)
    a.resend = False
    a, b = h.fanout.apply_beam_step([a], {a.req_id: [(3, -0.5), (4, -1.0)]})
    assert (a.req_id, b.req_id) == (0, 101) and h.running == [b]
    assert a.output_token_ids == [3] and b.output_token_ids == [4]
    assert a.resend and b.resend, "their next inputs were chosen on the host"
    assert h.kv.get_block_ids(b) == h.kv.get_block_ids(a), "the fork shares the beam's blocks"
    live = h.fanout.apply_beam_step([a, b], {a.req_id: [(5, -0.5), (6, -1.5)]})
    assert h.finished == [(b, RequestStatus.FINISHED_ABORTED)]
    assert live[0] is a and len(live) == 2
    fork = live[1]
    assert a.output_token_ids == [3, 5] and fork.output_token_ids == [3, 6]
    assert a.cumulative_logprob == -1.0 and fork.cumulative_logprob == -2.0
    assert a.group.members == [a, fork]
    assert h.kv.get_block_ids(fork) == h.kv.get_block_ids(a)


def test_a_hypothesis_is_a_finished_copy_holding_no_blocks():
    h = Harness()
    beam = h.admit(SamplingParams(n=1, best_of=2, use_beam_search=True, temperature=0.0))
    beam.append_output_token(4, -0.25)
    free = h.kv.get_num_free_gpu_blocks()
    hypothesis = h.fanout.new_hypothesis(PendingHypothesis(beam, 9, -1.0, RequestStatus.FINISHED_STOPPED))
    assert hypothesis.output_token_ids == [4, 9] and beam.output_token_ids == [4]
    assert hypothesis.cumulative_logprob == -1.25
    assert hypothesis.status == RequestStatus.FINISHED_STOPPED and hypothesis.req_id == 101
    assert hypothesis.group is beam.group and hypothesis not in beam.group.members
    assert h.kv.get_num_free_gpu_blocks() == free and h.running == []
