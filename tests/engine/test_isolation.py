"""Isolation inside the step: a model step that raises fails only the request responsible.

A fault is injected into every step that computes a chosen ("poison") request, while innocent
requests share those steps. The poison request must come back failed, every greedy innocent with
exactly the tokens of an undisturbed run, every block free, and the engine healthy. A device
fault, or steps failing whatever runs in them, make the engine give up instead. Torch backend,
float32, CPU: batch invariance holds exactly there, so recomputing changes no greedy token.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.core import MAX_REQUESTS_FAILED_IN_A_ROW
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.executor.abstract import ExecutorDeadError
from pagedllm.outputs import RequestOutput
from pagedllm.step_io import SchedulerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SAMPLED_N2 = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
VOCAB_SIZE = 160


@pytest.fixture(scope="module")
def model_dir(make_tiny_model_for_module) -> str:
    _, model_config = make_tiny_model_for_module(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    return model_config.model


def make_engine(model_dir: str, **kwargs: Any) -> LLMEngine:
    args = EngineArgs(
        model=model_dir,
        device="cpu",
        attention_backend="torch",
        num_kv_blocks=128,
        block_size=4,
        swap_space=0.01,
        **kwargs,
    )
    return LLMEngine.from_engine_args(args)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randint(3, 12))] for _ in range(n)]


def step_ends(scheduler_output: SchedulerOutput) -> dict[int, int]:
    """Per request of the step, its tokens computed once the step has run."""
    start = {data.req_id: data.num_computed_tokens for data in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    start.update(zip(cached.req_ids, cached.num_computed_tokens))
    return {req_id: start[req_id] + n for req_id, n in scheduler_output.num_scheduled_tokens.items()}


class _FailingGet:
    """A launched step whose samples never arrive."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def get(self) -> None:
        raise self.error


class Injector:
    """Makes a model step raise when ``poisoned(request_id, end)`` holds for one of its requests
    (``end``: the request's tokens computed once the step has run); records the requests of every
    step that failed. ``at``: "launch" raises instead of running it, "get" runs it and raises when
    its samples are awaited, "lost" too but undoes its KV cache writes first (a step whose device
    work went wrong)."""

    def __init__(
        self,
        engine: LLMEngine,
        monkeypatch: pytest.MonkeyPatch,
        poisoned: Callable[[str | None, int], bool],
        at: str = "launch",
        error: Callable[[], Exception] = lambda: RuntimeError("injected step failure"),
    ) -> None:
        self.failed_steps: list[set[str | None]] = []
        execute_model = engine.executor.execute_model

        def execute(scheduler_output: SchedulerOutput):
            ends = {engine.request_id_of(r): end for r, end in step_ends(scheduler_output).items()}
            if not any(poisoned(request_id, end) for request_id, end in ends.items()):
                return execute_model(scheduler_output)
            self.failed_steps.append(set(ends))
            if at == "launch":
                raise error()
            kv_caches = [t for layer in engine.executor.worker.cache_engine.gpu_cache for t in layer]
            before = [t.clone() for t in kv_caches] if at == "lost" else []
            execute_model(scheduler_output)
            for t, saved in zip(kv_caches, before):
                t.copy_(saved)
            return _FailingGet(error())

        monkeypatch.setattr(engine.executor, "execute_model", execute)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, RequestOutput]:
    """Every request to its end; each one's final output, checking that nothing ends twice."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt_token_ids=prompt, sampling_params=params)
    finals: dict[str, RequestOutput] = {}
    for _ in range(500):
        for output in engine.step():
            if output.finished:
                assert output.request_id not in finals
                finals[output.request_id] = output
        if not engine.has_unfinished_requests():
            return finals
    raise AssertionError("the requests did not finish")


def token_ids(output: RequestOutput) -> list[list[int]]:
    return [c.token_ids for c in output.outputs]


def assert_idle(engine: LLMEngine) -> None:
    kv = engine.scheduler.kv_cache_manager
    assert not engine.has_unfinished_requests() and not engine.scheduler.is_isolating
    assert kv.get_num_free_gpu_blocks() == kv.num_total_gpu_blocks
    assert kv.get_num_free_cpu_blocks() == kv.num_total_cpu_blocks
    engine.check_health()


def assert_failed(output: RequestOutput, num_outputs: int) -> None:
    assert output.failed and "injected step failure" in output.error
    assert len(output.outputs) == num_outputs
    assert all(c.finish_reason == "error" for c in output.outputs)


@pytest.fixture(scope="module")
def batch(model_dir) -> tuple[dict[str, tuple[list[int], SamplingParams]], dict[str, RequestOutput]]:
    """Six greedy requests, one n=2 seeded one and a poison one (n=2), and the outputs of an
    undisturbed run."""
    ids = prompts(8)
    requests = {f"r{i}": (ids[i], GREEDY) for i in range(6)}
    requests["n2"] = (ids[6], SAMPLED_N2)
    requests["poison"] = (ids[7], SAMPLED_N2)
    reference = run(make_engine(model_dir), requests)
    return requests, reference


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("at", ["launch", "get"])
@pytest.mark.parametrize("when", ["first step", "third decode"])
def test_a_poison_request_fails_alone_and_innocents_get_their_undisturbed_tokens(
    model_dir, batch, monkeypatch, async_scheduling, at, when
):
    requests, reference = batch
    prompt_len = len(requests["poison"][0])
    # "third decode": the step that computes its third output token (it has streamed two).
    first = 1 if when == "first step" else prompt_len + 3

    engine = make_engine(model_dir, async_scheduling=async_scheduling)
    injector = Injector(engine, monkeypatch, lambda rid, end: rid == "poison" and end >= first, at)
    finals = run(engine, requests)

    assert_failed(finals["poison"], num_outputs=1 if when == "first step" else 2)
    if when == "third decode":
        assert all(len(c.token_ids) >= 2 for c in finals["poison"].outputs)
    # The poison request failed in steps shared with innocents (several of them at once).
    assert max(len(step) for step in injector.failed_steps) > 2
    for request_id in (f"r{i}" for i in range(6)):
        assert not finals[request_id].failed and finals[request_id].error is None
        assert token_ids(finals[request_id]) == token_ids(reference[request_id])
    # A seeded sampling request may draw other tokens after recomputing, but loses none.
    assert [len(c.token_ids) for c in finals["n2"].outputs] == [10, 10]
    assert {c.finish_reason for c in finals["n2"].outputs} == {"length"}
    assert_idle(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_innocents_stream_on_and_every_token_streamed_stands(model_dir, monkeypatch, async_scheduling):
    """A request failing mid-stream: the innocents' streams already have tokens; nothing they were
    sent is taken back, and they end as they would have."""
    ids = prompts(5, seed=1)
    reference = run(make_engine(model_dir), {str(i): (p, GREEDY) for i, p in enumerate(ids)})
    engine = make_engine(model_dir, async_scheduling=async_scheduling)
    Injector(engine, monkeypatch, lambda rid, end: rid == "2" and end >= len(ids[2]) + 3)
    for i, prompt in enumerate(ids):
        engine.add_request(str(i), prompt_token_ids=prompt, sampling_params=GREEDY)
    streamed: dict[str, list[RequestOutput]] = {}
    for _ in range(200):
        for output in engine.step():
            streamed.setdefault(output.request_id, []).append(output)
        if not engine.has_unfinished_requests():
            break
    assert_failed(streamed["2"][-1], num_outputs=1)
    assert len(streamed["2"][-2].outputs[0].token_ids) >= 2  # it had streamed before it failed
    for request_id in ("0", "1", "3", "4"):
        final = reference[request_id].outputs[0].token_ids
        assert streamed[request_id][-1].outputs[0].token_ids == final
        for output in streamed[request_id]:  # every streamed output is a prefix of the final one
            assert final[: len(output.outputs[0].token_ids)] == output.outputs[0].token_ids
    assert_idle(engine)


def test_a_poison_request_first_in_a_large_batch_fails_alone(model_dir, monkeypatch):
    """It is in the first half probed at every split: the steps fail back to back, all the way
    down from 64 requests, and the engine must not take that for a broken model."""
    ids = prompts(64, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    requests = {str(i): (p, params) for i, p in enumerate(ids)}
    reference = run(make_engine(model_dir), requests)
    engine = make_engine(model_dir, async_scheduling=True)
    injector = Injector(engine, monkeypatch, lambda rid, end: rid == "0")
    finals = run(engine, requests)
    sizes = [len(step) for step in injector.failed_steps]  # the first batch, then halves of it
    assert sizes[0] > 32 and sizes[-1] == 1 and all(b == a // 2 for a, b in itertools.pairwise(sizes))
    assert [rid for rid, out in finals.items() if out.failed] == ["0"]
    assert all(token_ids(finals[rid]) == token_ids(reference[rid]) for rid in requests if rid != "0")
    assert_idle(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_beam_search_beside_a_poison_request_ends_as_undisturbed(model_dir, monkeypatch, async_scheduling):
    ids = prompts(4, seed=8)
    beams = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=8)
    requests = {"beams": (ids[0], beams), "greedy": (ids[1], GREEDY), "poison": (ids[2], GREEDY)}
    reference = run(make_engine(model_dir), requests)
    engine = make_engine(model_dir, async_scheduling=async_scheduling)
    Injector(engine, monkeypatch, lambda rid, end: rid == "poison" and end > len(ids[2]) + 2)
    finals = run(engine, requests)
    assert finals["poison"].failed
    assert token_ids(finals["beams"]) == token_ids(reference["beams"])
    assert token_ids(finals["greedy"]) == token_ids(reference["greedy"])
    assert_idle(engine)


def test_two_poison_requests_among_innocents_are_both_found(model_dir, monkeypatch):
    ids = prompts(10, seed=2)
    requests = {str(i): (p, GREEDY) for i, p in enumerate(ids)}
    reference = run(make_engine(model_dir), requests)
    engine = make_engine(model_dir, async_scheduling=True)
    injector = Injector(engine, monkeypatch, lambda rid, end: rid in {"3", "8"} and end > len(ids[int(rid)]))
    finals = run(engine, requests)
    assert {rid for rid, out in finals.items() if out.failed} == {"3", "8"}
    for request_id in set(requests) - {"3", "8"}:
        assert token_ids(finals[request_id]) == token_ids(reference[request_id])
    # Binary search: far fewer failed steps than a probe per request would need for both.
    assert len(injector.failed_steps) < 2 * len(requests)
    assert_idle(engine)


def once(predicate: Callable[[str | None, int], bool]) -> Callable[[str | None, int], bool]:
    """``predicate`` for the first step it holds for, False ever after."""
    fired: list[bool] = []

    def poisoned(request_id: str | None, end: int) -> bool:
        if fired or not predicate(request_id, end):
            return False
        fired.append(True)
        return True

    return poisoned


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_steps_that_fail_once_fail_nobody(model_dir, monkeypatch, enable_prefix_caching):
    """Two one-off failures, the first losing a step that completes a block: no request is to
    blame, so none fails, and none loses a token. With prefix caching, the block that step was
    filling must not be found when the requests are recomputed after the second failure."""
    ids = prompts(6, seed=3)
    requests = {str(i): (p, GREEDY) for i, p in enumerate(ids)}
    reference = run(make_engine(model_dir, enable_prefix_caching=enable_prefix_caching), requests)
    engine = make_engine(model_dir, enable_prefix_caching=enable_prefix_caching, async_scheduling=True)
    decode_ends = range(len(ids[0]) + 2, len(ids[0]) + 10)
    block_end = once(lambda rid, end: rid == "0" and end in decode_ends and end % 4 == 0)
    lost = Injector(engine, monkeypatch, block_end, at="lost")
    later = Injector(engine, monkeypatch, once(lambda rid, end: rid == "0" and end >= max(decode_ends)))
    finals = run(engine, requests)
    assert len(lost.failed_steps) == len(later.failed_steps) == 1
    assert {rid: token_ids(out) for rid, out in finals.items()} == {
        rid: token_ids(out) for rid, out in reference.items()
    }
    assert not any(out.failed for out in finals.values())
    assert_idle(engine)


def test_a_device_fault_kills_the_engine_without_isolation(model_dir, monkeypatch):
    engine = make_engine(model_dir, async_scheduling=True)
    fault = "CUDA error: an illegal memory access was encountered"
    Injector(engine, monkeypatch, lambda rid, end: rid == "1", error=lambda: torch.AcceleratorError(fault))
    for i, prompt in enumerate(prompts(4, seed=5)):
        engine.add_request(str(i), prompt_token_ids=prompt, sampling_params=GREEDY)
    with pytest.raises(ExecutorDeadError, match="illegal memory access"):
        for _ in range(50):
            assert not any(output.failed for output in engine.step())
    assert not engine.scheduler.is_isolating
    with pytest.raises(ExecutorDeadError, match="device reported a fault"):
        engine.check_health()
    with pytest.raises(ExecutorDeadError):
        engine.step()
    # What the caller does with a dead engine: end its requests, which frees their blocks.
    engine.abort_request(list(engine.requests))
    kv = engine.scheduler.kv_cache_manager
    assert kv.get_num_free_gpu_blocks() == kv.num_total_gpu_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steps_failing_whatever_runs_make_the_engine_give_up(model_dir, monkeypatch, async_scheduling):
    engine = make_engine(model_dir, async_scheduling=async_scheduling)
    injector = Injector(engine, monkeypatch, lambda rid, end: True)
    for i, prompt in enumerate(prompts(12, seed=6)):
        engine.add_request(str(i), prompt_token_ids=prompt, sampling_params=GREEDY)
    failed = []
    with pytest.raises(ExecutorDeadError, match="model steps fail whatever runs in them"):
        for _ in range(100):
            failed += [output.request_id for output in engine.step() if output.failed]
    # Probes convicted requests one after another, nothing succeeding between, until the limit.
    assert len(failed) == MAX_REQUESTS_FAILED_IN_A_ROW
    assert len(injector.failed_steps) <= (MAX_REQUESTS_FAILED_IN_A_ROW + 1) * 6  # 6: log2(12) + 2
    with pytest.raises(ExecutorDeadError):
        engine.step()
    engine.abort_request(list(engine.requests))
    kv = engine.scheduler.kv_cache_manager
    assert kv.get_num_free_gpu_blocks() == kv.num_total_gpu_blocks
