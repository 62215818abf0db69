"""AsyncLLMEngine: per-request streams from a background engine thread, aborts that free blocks,
and failures that end only the request responsible (or, when the engine is broken, all of them)
without leaving anyone waiting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import pytest
from transformers import LlamaConfig

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.async_engine import AsyncEngineDeadError, AsyncLLMEngine, RequestFailedError
from pagedllm.engine.llm_engine import LLMEngine

# No test may wait longer than this for the engine: a hang is a failure, not a stuck suite.
TIMEOUT_S = 30
MODEL_OVERRIDES = {"num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture
def make_engine(make_tiny_model):
    def make(**engine_kwargs: Any) -> LLMEngine:
        _, model_config = make_tiny_model(LlamaConfig, **MODEL_OVERRIDES)
        # A small swap space: allocating the default 4 GiB takes seconds.
        args = EngineArgs(
            model=model_config.model, num_kv_blocks=64, block_size=4, swap_space=0.01, **engine_kwargs
        )
        return LLMEngine.from_engine_args(args)

    return make


def run(coroutine: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def wait_for(condition, what: str) -> None:
    for _ in range(TIMEOUT_S * 100):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def all_blocks_free(engine: AsyncLLMEngine) -> bool:
    return engine.stats.num_free_gpu_blocks == engine.stats.num_gpu_blocks


def fail_steps_of(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, request_ids: set[str] | None) -> None:
    """Make every step that runs one of ``request_ids`` (every step, when None) raise."""
    execute_model = engine.executor.execute_model

    def failing(scheduler_output):
        scheduled = {engine.request_id_of(req_id) for req_id in scheduler_output.num_scheduled_tokens}
        if request_ids is None or scheduled & request_ids:
            raise RuntimeError("injected step failure")
        return execute_model(scheduler_output)

    monkeypatch.setattr(engine.executor, "execute_model", failing)


async def collect(engine: AsyncLLMEngine, request_id: str, prompt: list[int], max_tokens: int):
    outputs = [
        output
        async for output in engine.generate(request_id, None, params(max_tokens), prompt_token_ids=prompt)
    ]
    return outputs


def test_concurrent_streams_get_every_token_and_free_their_blocks(make_engine):
    async def main() -> None:
        engine = AsyncLLMEngine(make_engine())
        engine.start()
        runs = [collect(engine, f"r{i}", [1 + i, 2, 3, 4, 5], max_tokens=8 + i) for i in range(4)]
        results = await asyncio.gather(*runs)
        for i, outputs in enumerate(results):
            assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
            assert len(outputs[-1].outputs[0].token_ids) == 8 + i
            assert outputs[-1].outputs[0].finish_reason == "length"
        assert all_blocks_free(engine) and engine.num_unfinished_requests == 0
        await engine.shutdown()
        assert not engine.is_running

    run(main())


@pytest.mark.parametrize("how", ["abort", "leave the loop"])
def test_abort_frees_the_blocks_at_the_next_step(make_engine, how):
    async def main() -> None:
        engine = AsyncLLMEngine(make_engine())
        engine.start()
        stream = engine.generate("long", None, params(200), prompt_token_ids=[1, 2, 3])
        async for output in stream:
            if len(output.outputs[0].token_ids) >= 2:
                break
        assert not all_blocks_free(engine)
        if how == "abort":
            engine.abort("long")
        else:
            await stream.aclose()
        await wait_for(lambda: all_blocks_free(engine), "the aborted request's blocks")
        assert engine.num_aborted_requests == 1 and engine.stats.num_running == 0
        # The engine goes on serving.
        outputs = await collect(engine, "next", [4, 5, 6], max_tokens=3)
        assert len(outputs[-1].outputs[0].token_ids) == 3
        await engine.shutdown()

    run(main())


def test_a_bad_request_raises_before_any_output(make_engine):
    async def main() -> None:
        engine = AsyncLLMEngine(make_engine())
        engine.start()
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.add_request("bad", prompt_token_ids=[10**6], sampling_params=params(4))
        outputs = await collect(engine, "bad", [1, 2], max_tokens=2)  # the id is free again
        assert outputs[-1].finished and engine.is_healthy
        await engine.shutdown()

    run(main())


def test_a_failing_step_fails_its_requests_and_the_engine_serves_the_rest(make_engine, monkeypatch):
    async def main() -> None:
        # One sequence per step: the poisoned request runs alone, the other waits its turn.
        llm_engine = make_engine(max_num_seqs=1)
        fail_steps_of(llm_engine, monkeypatch, {"poison"})
        engine = AsyncLLMEngine(llm_engine)
        engine.start()
        poison = asyncio.ensure_future(collect(engine, "poison", [1, 2, 3], max_tokens=4))
        await asyncio.sleep(0)  # queued first, so it runs first
        waiting = asyncio.ensure_future(collect(engine, "waiting", [4, 5, 6], max_tokens=4))
        with pytest.raises(RequestFailedError, match="injected step failure"):
            await poison
        outputs = await waiting
        assert len(outputs[-1].outputs[0].token_ids) == 4
        assert engine.is_healthy and engine.num_failed_requests == 1
        assert all_blocks_free(engine)
        await engine.shutdown()

    run(main())


def test_a_poison_request_fails_alone_and_the_streams_beside_it_finish_whole(make_engine, monkeypatch):
    prompts = {f"r{i}": [1 + i, 2, 3, 4, 5] for i in range(4)}
    reference = make_engine(attention_backend="torch")
    for request_id, prompt in prompts.items():
        reference.add_request(request_id, prompt_token_ids=prompt, sampling_params=params(12))
    expected: dict[str, list[int]] = {}
    while reference.has_unfinished_requests():
        expected.update({o.request_id: o.outputs[0].token_ids for o in reference.step() if o.finished})

    async def stream(engine: AsyncLLMEngine, request_id: str, prompt: list[int]) -> list[list[int]]:
        return [
            output.outputs[0].token_ids
            async for output in engine.generate(request_id, None, params(12), prompt_token_ids=prompt)
        ]

    async def main() -> None:
        llm_engine = make_engine(attention_backend="torch")
        fail_steps_of(llm_engine, monkeypatch, {"poison"})
        engine = AsyncLLMEngine(llm_engine)
        engine.start()
        victims = [asyncio.ensure_future(stream(engine, rid, prompt)) for rid, prompt in prompts.items()]
        await wait_for(lambda: engine.stats.num_running == len(prompts), "the victims to run")
        # Joins their batch mid-stream: every step it takes part in raises.
        with pytest.raises(RequestFailedError, match="injected step failure"):
            await collect(engine, "poison", [9, 8, 7], max_tokens=12)
        for request_id, streamed in zip(prompts, await asyncio.gather(*victims)):
            assert streamed[-1] == expected[request_id]
            # Nothing streamed is ever taken back.
            assert all(tokens == expected[request_id][: len(tokens)] for tokens in streamed)
        assert engine.is_healthy and engine.num_failed_requests == 1
        assert all_blocks_free(engine) and engine.num_unfinished_requests == 0
        await engine.shutdown()

    run(main())


def test_a_broken_engine_turns_unhealthy_and_no_request_hangs(make_engine, monkeypatch):
    async def main() -> None:
        llm_engine = make_engine(max_num_seqs=1)
        fail_steps_of(llm_engine, monkeypatch, None)
        engine = AsyncLLMEngine(llm_engine)
        engine.start()
        runs = [collect(engine, f"r{i}", [1 + i, 2, 3], max_tokens=4) for i in range(6)]
        results = await asyncio.gather(*runs, return_exceptions=True)
        assert all(isinstance(r, (RequestFailedError, AsyncEngineDeadError)) for r in results), results
        assert any(isinstance(r, AsyncEngineDeadError) for r in results)
        assert not engine.is_healthy
        with pytest.raises(AsyncEngineDeadError):
            await engine.add_request("late", prompt_token_ids=[1], sampling_params=params(1))
        await engine.shutdown()

    run(main())


def test_shutdown_ends_running_requests_with_an_error(make_engine):
    async def main() -> None:
        engine = AsyncLLMEngine(make_engine())
        engine.start()
        stream = await engine.add_request("long", prompt_token_ids=[1, 2], sampling_params=params(500))
        await stream.__anext__()
        await engine.shutdown()
        with pytest.raises(AsyncEngineDeadError):
            async for _ in stream:
                pass
        assert not engine.is_running

    run(main())


def test_a_request_aborted_as_it_finishes_is_counted_exactly_once(make_engine):
    """The client leaves after the engine finished its request but before the output reached the
    event loop: the frontend has not seen it finish, so it counts an abort, and the finished output
    that arrives after is dropped, not counted as a success too."""

    async def main() -> None:
        llm_engine = make_engine()
        finished: list[str] = []
        engine = AsyncLLMEngine(
            llm_engine, on_request_finished=lambda output: finished.append(output.request_id)
        )
        engine.start()
        await engine.add_request("racing", prompt_token_ids=[1, 2, 3], sampling_params=params(2))
        # Block the event loop (so no output is delivered) until the engine has finished it.
        deadline = time.monotonic() + TIMEOUT_S
        while llm_engine.has_unfinished_requests() or llm_engine.get_stats().num_running:
            assert time.monotonic() < deadline, "the engine did not finish the request"
            time.sleep(0.01)
        time.sleep(0.1)  # and has handed its outputs to the event loop's queue
        engine.abort("racing")  # the client leaves now
        await wait_for(lambda: engine.stats.num_running == 0 and all_blocks_free(engine), "the engine idle")
        await asyncio.sleep(0.2)  # the abort applied (or found nothing) on the engine's side
        assert len(finished) + engine.num_aborted_requests == 1, (finished, engine.num_aborted_requests)
        await engine.shutdown()

    run(main())
