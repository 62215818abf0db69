"""The data-parallel router's policy (least loaded, prefix affinity within a margin) and the
DataParallelCore's routing of ops, against fake replicas: no model, no process."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from pagedllm import LLM
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_messages import AbortRequests, AddRequest, CoreOutputs, EngineDead, FinishSequences
from pagedllm.engine.dp_client import (
    DataParallelCore,
    check_data_parallel,
    replica_engine_args,
    replica_env,
)
from pagedllm.engine.dp_router import WAITING_TOKENS_PER_REQUEST, DataParallelRouter
from pagedllm.engine.stats import EngineStats
from pagedllm.sampling_params import SamplingParams
from pagedllm.step_io import EngineCoreOutputs, EngineCoreRequest

BLOCK_SIZE = 4


def live_request(first_token_time: float | None = None) -> SimpleNamespace:
    """A frontend request state as the router reads it."""
    return SimpleNamespace(metrics=SimpleNamespace(first_token_time=first_token_time))


def router(num_engines: int = 2, **kwargs) -> tuple[DataParallelRouter, dict]:
    live: dict[str, SimpleNamespace] = {}
    r = DataParallelRouter(num_engines, BLOCK_SIZE, **kwargs)
    r.track(live)
    return r, live


def add(r: DataParallelRouter, live: dict, request_id: str, prompt: list[int], running: bool = True) -> int:
    """Route a request as the frontend does (live before it is sent), then let it start running
    (its first token seen) unless ``running`` is False."""
    live[request_id] = live_request()
    engine = r.route(request_id, prompt)
    if running:
        live[request_id].metrics.first_token_time = 1.0
    return engine


def test_new_requests_go_to_the_least_loaded_replica():
    r, live = router(num_engines=3)
    # Distinct prompts (no shared block): each goes where the fewest requests are.
    engines = [add(r, live, f"r{i}", [100 + i] * 8) for i in range(6)]
    assert sorted(engines) == [0, 0, 1, 1, 2, 2]
    assert [load.num_requests for load in r.loads()] == [2, 2, 2]
    # Two finish on replica 1: it is the least loaded now.
    for request_id in [f"r{i}" for i, e in enumerate(engines) if e == 1]:
        del live[request_id]
    assert add(r, live, "next", [7] * 8) == 1


def test_waiting_prompt_tokens_weigh_on_the_load():
    r, live = router()
    # Replica 0 gets a long prompt still prefilling; replica 1 two short running requests.
    assert add(r, live, "long", list(range(4 * WAITING_TOKENS_PER_REQUEST)), running=False) == 0
    assert add(r, live, "a", [1] * 8) == 1
    assert add(r, live, "b", [2] * 8) == 1
    loads = r.loads()
    assert loads[0].num_waiting_tokens == 4 * WAITING_TOKENS_PER_REQUEST
    assert loads[0].score == pytest.approx(5.0) and loads[1].score == pytest.approx(2.0)
    assert add(r, live, "c", [3] * 8) == 1  # 2 < 5: the prefill queue counts
    # Once the long prompt has its first token it is one request among others.
    live["long"].metrics.first_token_time = 2.0
    assert add(r, live, "d", [4] * 8) == 0


def test_a_conversation_follows_its_prefix():
    r, live = router()
    turn1 = list(range(10, 30))  # 5 full blocks
    first = add(r, live, "turn1", turn1)
    # Load the other replica less: without affinity turn 2 would go there.
    other = add(r, live, "x", [1] * 8)
    assert other != first
    del live["x"]
    turn2 = [*turn1, 31, 32, 33, 34, 35, 36]  # the same blocks, then its own
    assert add(r, live, "turn2", turn2) == first
    assert r.num_affinity_hits == 1


def test_the_deepest_matching_block_wins():
    r, live = router(affinity_margin=0.5)
    system = [9] * BLOCK_SIZE  # one block every conversation shares
    conv_a = [*system, *range(40, 48)]
    conv_b = [*system, *range(60, 68)]
    assert add(r, live, "a1", conv_a) == 0
    # b1 shares only the system block with a1, and replica 0 is past the margin: it goes to 1,
    # which is now where the system block last went.
    assert add(r, live, "b1", conv_b) == 1
    # Each conversation's next turn goes where its own deepest block is, not the shared one's.
    assert add(r, live, "a2", [*conv_a, 1, 2, 3, 4]) == 0
    assert add(r, live, "b2", [*conv_b, 5, 6, 7, 8]) == 1
    assert r.num_affinity_hits == 2


def test_affinity_is_honoured_up_to_the_margin_then_overridden():
    r, live = router(affinity_margin=2.0)
    prompt = list(range(50, 70))
    # A hot prefix: every request starts with it. Replica 0 takes it while its load is at most
    # the other's + 2 (0 + 2), then it spreads.
    placed = [add(r, live, f"turn{i}", [*prompt, i, i, i, i]) for i in range(4)]
    assert placed == [0, 0, 0, 1]
    assert r.num_affinity_hits == 2
    assert [load.num_requests for load in r.loads()] == [3, 1]


def test_without_prefix_caching_there_is_no_affinity():
    r, live = router(prefix_affinity=False)
    prompt = list(range(16))
    assert add(r, live, "a", prompt) == 0
    assert add(r, live, "b", prompt) == 1
    assert r.num_affinity_hits == 0


def test_adapters_never_share_a_prefix():
    r, live = router()
    prompt = list(range(16))
    live["a"] = live_request(1.0)
    home = r.route("a", prompt, cache_salt=("adapter-1", 1, "/p1"))
    live["b"] = live_request(1.0)
    assert r.route("b", prompt, cache_salt=("adapter-2", 2, "/p2")) == 1 - home


def test_finished_requests_are_forgotten():
    r, live = router()
    add(r, live, "a", [1] * 8)
    assert r.engine_of("a") is not None
    del live["a"]
    r.loads()
    assert r.engine_of("a") is None


# --- DataParallelCore: ops to the right replica ------------------------------------------------


def stats(num_running: int = 0, num_gpu_blocks: int = 10) -> EngineStats:
    return EngineStats(num_running, 0, 0, num_gpu_blocks, num_gpu_blocks, 0, 0, 0, 0, 5, 7, 0.5)


class FakeCore:
    def __init__(self) -> None:
        self.config = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=BLOCK_SIZE, enable_prefix_caching=True),
            scheduler_block_size=BLOCK_SIZE,
        )
        self.tokenizer = None
        self.num_gpu_blocks = 10
        self.initial_stats = stats()
        self.sent: list = []
        self.deliver = None
        self.alive = True

    def start(self, deliver) -> None:
        self.deliver = deliver

    def send(self, op) -> None:
        self.sent.append(op)

    def is_alive(self) -> bool:
        return self.alive

    def close(self, timeout: float) -> None:
        self.alive = False


def core_request(request_id: str, prompt: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=4), (0,), 0.0)


@pytest.fixture
def dp_core() -> tuple[DataParallelCore, list[FakeCore], dict, list]:
    fakes = [FakeCore(), FakeCore()]
    core = DataParallelCore(fakes)
    live: dict = {}
    core.router.track(live)
    delivered: list = []
    core.start(delivered.append)
    return core, fakes, live, delivered


def test_ops_follow_their_request(dp_core):
    core, fakes, live, _ = dp_core
    for i, request_id in enumerate(["a", "b"]):
        live[request_id] = live_request()
        core.send(AddRequest(i, core_request(request_id, [i] * 8)))
    assert [[op.request.request_id for op in fake.sent] for fake in fakes] == [["a"], ["b"]]
    core.send(AbortRequests(["b", "a"]))
    core.send(FinishSequences([("a", 0), ("b", 1)]))
    assert [op.request_ids for op in fakes[0].sent[1:2]] == [["a"]]
    assert [op.request_ids for op in fakes[1].sent[1:2]] == [["b"]]
    assert fakes[0].sent[2].stopped == [("a", 0)] and fakes[1].sent[2].stopped == [("b", 1)]
    # An abort of a request the router does not know reaches every replica (a no-op where absent).
    core.send(AbortRequests(["unknown"]))
    assert fakes[0].sent[-1].request_ids == fakes[1].sent[-1].request_ids == ["unknown"]


def test_stats_are_summed_and_a_dead_replica_names_itself(dp_core):
    core, fakes, _, delivered = dp_core
    fakes[1].deliver(CoreOutputs(EngineCoreOutputs(), stats(num_running=3)))
    fakes[0].deliver(CoreOutputs(EngineCoreOutputs(), stats(num_running=2)))
    assert delivered[-1].stats.num_running == 5 and delivered[-1].stats.num_gpu_blocks == 20
    assert [s.num_running for s in core.engine_stats] == [2, 3]
    fakes[1].alive = False
    fakes[1].deliver(EngineDead("the engine process died (exit code -9)"))
    assert not core.is_alive()
    assert "data-parallel engine 1 of 2" in delivered[-1].reason and "died" in delivered[-1].reason


# --- sizes and devices ------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_bad_data_parallel_size_is_refused_naming_it(size):
    with pytest.raises(ValueError, match="data_parallel_size"):
        check_data_parallel(EngineArgs(data_parallel_size=size, device="cpu"))


def test_one_engine_refuses_data_parallelism_pointing_to_serve():
    with pytest.raises(ValueError, match="pagedllm serve --data-parallel-size"):
        EngineArgs(data_parallel_size=2, device="cpu").create_engine_config()
    # The offline LLM refuses it before looking for the model.
    with pytest.raises(ValueError, match="data_parallel_size=2: one engine"):
        LLM("/no/such/model", data_parallel_size=2)


def test_more_devices_than_visible_are_refused_naming_the_sizes(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = EngineArgs(data_parallel_size=2, tensor_parallel_size=2, device="cuda")
    with pytest.raises(
        ValueError, match=r"data_parallel_size \(2\) x tensor_parallel_size \(2\) = 4 .* 2 CUDA"
    ):
        check_data_parallel(args)
    check_data_parallel(EngineArgs(data_parallel_size=2, device="cuda"))  # 2 x 1 fits


def test_each_replica_sees_its_slice_of_the_visible_devices():
    devices = ["4", "5", "6", "7"]
    assert replica_env(0, 2, devices) == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert replica_env(1, 2, devices) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert replica_env(1, 1, []) == {}  # the CPU


def test_cpu_replicas_split_the_cores(monkeypatch):
    monkeypatch.setattr("pagedllm.engine.dp_client.physical_cpu_cores", lambda: 16)
    args = EngineArgs(data_parallel_size=2, tensor_parallel_size=2, device="cpu", seed=3)
    replica = replica_engine_args(args, on_cuda=False)
    assert (replica.data_parallel_size, replica.threads, replica.seed) == (1, 4, 3)
    assert replica_engine_args(EngineArgs(data_parallel_size=2, threads=3), on_cuda=False).threads == 3


def test_replica_stats_sum_as_one_engines():
    from pagedllm.core.spec_decode import SpecDecodingStats
    from pagedllm.engine.stats import sum_engine_stats

    a = dataclasses.replace(stats(num_running=1), spec_decoding=SpecDecodingStats(1, 4, 2, [1, 1]))
    b = dataclasses.replace(stats(num_running=2), prefix_cache_hit_rate=0.25)
    b.spec_decoding = SpecDecodingStats(2, 6, 3, [2, 1, 0])
    total = sum_engine_stats([a, b])
    assert (total.num_running, total.num_gpu_blocks, total.num_prefill_tokens) == (3, 20, 10)
    assert total.prefix_cache_hit_rate == pytest.approx(0.375)
    assert total.spec_decoding == SpecDecodingStats(3, 10, 5, [3, 2, 0])
    assert sum_engine_stats([stats(), stats()]).spec_decoding is None
