"""The engine core in a process of its own (``AsyncLLMEngine.in_engine_process``, the server's
default): it serves what the in-thread core serves, output for output; a step crosses as token
ids whose size does not grow with the output; grammars compile off the engine loop; a dead engine process
fails every stream and turns the engine unhealthy; bad arguments fail at startup."""

from __future__ import annotations

import asyncio
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.async_engine import AsyncEngineDeadError, AsyncLLMEngine
from pagedllm.engine.core import EngineCore
from pagedllm.engine.core_messages import AbortRequests, AddRequest, AddResult, CoreOutputs
from pagedllm.engine.core_proc import EngineCoreLoop
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.outputs import CompletionOutput
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.step_io import EngineCoreRequest

TIMEOUT_S = 60
REGEX = "(ab|c)+"
REGEX = "(ab|c)+"


def run(coroutine: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


def _core_kwargs(model_dir: str, **overrides: Any) -> dict[str, Any]:
    # The torch backend is batch invariant: a request's tokens do not depend on its neighbours.
    kwargs = dict(num_kv_blocks=128, block_size=8, max_model_len=256, swap_space=0.01)
    return dict(model=model_dir, device="cpu", attention_backend="torch", **{**kwargs, **overrides})


def engine_args(model_dir: str, **overrides: Any) -> EngineArgs:
    return EngineArgs(**_core_kwargs(model_dir, **overrides))


# --- what crosses the pipe --------------------------------------------------------------------


def test_a_step_crosses_as_token_ids_whose_size_does_not_grow_with_the_output(tiny_llama_with_tokenizer):
    """The core sends each sequence's new token ids, never text or what was sent before: a long
    stream costs the same bytes per step at its end as at its start."""
    core = EngineCore(EngineArgs(**_core_kwargs(tiny_llama_with_tokenizer)).create_engine_config())
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=1)
    core.add_request(EngineCoreRequest("r", [10, 11, 12], params, (), 0.0))
    sizes, tokens = [], []
    while core.has_unfinished_requests():
        outputs = pickle.loads(pickle.dumps(core.step()))
        sizes.append(len(pickle.dumps(outputs)))
        tokens += [t for o in outputs.outputs for t in o.new_token_ids]
        assert all(not hasattr(o, "text") for o in outputs.outputs)
    assert len(tokens) == 60 and "r" in outputs.finished_requests
    assert max(sizes[2:-1]) - min(sizes[2:-1]) < 16  # one token and its logprobs, whatever came before


# --- the engine core's loop -------------------------------------------------------------------


def test_an_add_waiting_for_its_grammar_is_withdrawn_by_its_abort(tiny_llama_with_tokenizer, monkeypatch):
    """Grammars compile off the engine loop; an abort that overtakes the compilation must keep
    the request from ever starting, and the add still gets its answer."""
    engine = LLMEngine.from_engine_args(engine_args(tiny_llama_with_tokenizer))
    pending: list[Future] = []

    def compile_never(params: StructuredOutputsParams) -> Future:
        pending.append(Future())
        return pending[-1]

    manager = engine.structured_output_manager
    monkeypatch.setattr(manager, "compile", compile_never)
    messages: list[Any] = []
    loop = EngineCoreLoop(engine.engine_core, messages.append, manager)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    loop.ops.put(AddRequest(0, EngineCoreRequest("r", [10, 11, 12], params, (), 0.0)))
    loop.ops.put(AbortRequests(["r"]))
    loop.ops.put(None)
    loop.run()
    results = [m for m in messages if isinstance(m, AddResult)]
    assert len(results) == 1 and "aborted" in str(results[0].error)
    assert not engine.has_unfinished_requests() and len(pending) == 1


def test_an_add_joins_once_its_grammar_compiled(tiny_llama_with_tokenizer):
    engine = LLMEngine.from_engine_args(engine_args(tiny_llama_with_tokenizer))
    messages: list[Any] = []

    def emit(message: Any) -> None:
        messages.append(message)
        if isinstance(message, CoreOutputs) and message.outputs.finished_requests:
            loop.ops.put(None)

    loop = EngineCoreLoop(engine.engine_core, emit, engine.structured_output_manager)
    regex = StructuredOutputsParams(regex="[ab]+")
    params = SamplingParams(max_tokens=6, temperature=0.0, structured_outputs=regex)
    loop.ops.put(AddRequest(0, EngineCoreRequest("r", [10, 11, 12], params, (), 0.0)))
    loop.run()
    assert [m.error for m in messages if isinstance(m, AddResult)] == [None]
    tokens = [
        t for m in messages if isinstance(m, CoreOutputs) for o in m.outputs.outputs for t in o.new_token_ids
    ]
    assert re.fullmatch("[ab]+", engine.tokenizer.decode(tokens))


# --- the engine process -----------------------------------------------------------------------


async def _serve(engine: AsyncLLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Every request at once; per request, its final outputs' (token ids, text, logprobs, finish)."""

    async def one(request_id: str, prompt: list[int], params: SamplingParams) -> list:
        async for output in engine.generate(request_id, prompt_token_ids=prompt, sampling_params=params):
            last = output
        assert last.finished
        return [_summary(c) for c in last.outputs]

    results = await asyncio.gather(*(one(rid, *request) for rid, request in requests.items()))
    return dict(zip(requests, results))


def _summary(c: CompletionOutput) -> tuple:
    return (c.token_ids, c.text, c.logprobs, c.finish_reason, c.stop_reason)


def _requests() -> dict[str, tuple[list[int], SamplingParams]]:
    greedy = dict(temperature=0.0, ignore_eos=True)
    return {
        "plain": ([10, 20, 30], SamplingParams(max_tokens=12, **greedy)),
        "logprobs": ([40, 41], SamplingParams(max_tokens=9, logprobs=2, **greedy)),
        "stop": ([7, 8, 9, 10], SamplingParams(max_tokens=30, stop=["a", "e"], **greedy)),
        "n2": ([5, 6], SamplingParams(max_tokens=7, n=2, temperature=0.8, seed=3)),
        "regex": (
            [11, 12],
            SamplingParams(
                max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=REGEX)
            ),
        ),
    }


@pytest.mark.slow
def test_the_engine_process_serves_what_the_thread_serves(tiny_llama_with_tokenizer):
    async def serve(engine: AsyncLLMEngine) -> tuple[dict, Any]:
        engine.start()
        try:
            results = await _serve(engine, _requests())
            for _ in range(100):  # the stats after the last step may trail its outputs
                if engine.stats.num_free_gpu_blocks == engine.stats.num_gpu_blocks:
                    break
                await asyncio.sleep(0.05)
            return results, engine.stats
        finally:
            await engine.shutdown()

    args = engine_args(tiny_llama_with_tokenizer)
    in_thread, _ = run(serve(AsyncLLMEngine(LLMEngine.from_engine_args(args))))
    process_engine = AsyncLLMEngine.in_engine_process(args)
    in_process, stats = run(serve(process_engine))
    assert in_process == in_thread
    assert re.fullmatch(REGEX, in_process["regex"][0][1])
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert not process_engine._core.process.is_alive() and process_engine._core.process.exitcode == 0


def test_bad_requests_are_refused_across_the_process_and_aborts_free_blocks(tiny_llama_with_tokenizer):
    async def body() -> None:
        engine = AsyncLLMEngine.in_engine_process(engine_args(tiny_llama_with_tokenizer))
        engine.start()
        try:
            with pytest.raises(ValueError, match="prompt token id"):
                await engine.add_request("bad", prompt_token_ids=[10, 10**9])
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            stream = await engine.add_request("long", prompt_token_ids=[1, 2, 3], sampling_params=params)
            first = await stream.__anext__()
            assert not first.finished
            engine.abort("long")
            for _ in range(200):
                if engine.stats.num_free_gpu_blocks == engine.stats.num_gpu_blocks:
                    break
                await asyncio.sleep(0.05)
            assert engine.stats.num_free_gpu_blocks == engine.stats.num_gpu_blocks
            assert engine.num_aborted_requests == 1
            assert engine.is_healthy
        finally:
            await engine.shutdown()

    run(body())


@pytest.mark.slow
def test_a_dead_engine_process_fails_every_stream_and_turns_unhealthy(tiny_llama_with_tokenizer):
    async def body() -> None:
        engine = AsyncLLMEngine.in_engine_process(engine_args(tiny_llama_with_tokenizer))
        engine.start()
        try:
            params = SamplingParams(max_tokens=240, ignore_eos=True)
            stream = await engine.add_request("r", prompt_token_ids=[1, 2, 3], sampling_params=params)
            other = await engine.add_request("other", prompt_token_ids=[4, 5], sampling_params=params)
            await stream.__anext__()
            os.kill(engine._core.process.pid, signal.SIGKILL)
            engine._core.process.join(10)
            # Before the event loop hears of the death, a client leaves: its abort finds the pipe
            # broken, and must not raise into the handler that is cleaning up.
            engine.abort("other")
            assert other.finished
            with pytest.raises(AsyncEngineDeadError, match="engine process died"):
                async for _ in stream:
                    pass
            assert not engine.is_healthy and "died" in engine.dead_reason()
            with pytest.raises(AsyncEngineDeadError):
                await engine.add_request("late", prompt_token_ids=[1], sampling_params=params)
        finally:
            await engine.shutdown()

    run(body())


@pytest.mark.slow
def test_bad_engine_arguments_fail_at_startup_with_their_error(tiny_llama_with_tokenizer):
    with pytest.raises(ValueError, match="max_model_len"):
        AsyncLLMEngine.in_engine_process(engine_args(tiny_llama_with_tokenizer, num_kv_blocks=2))


FRONTEND = """
import sys, time
from pagedllm import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine

if __name__ == "__main__":
    args = EngineArgs(model=sys.argv[1], device="cpu", swap_space=0.01, num_kv_blocks=64, max_model_len=256)
    engine = AsyncLLMEngine.in_engine_process(args)
    print(engine._core.process.pid, flush=True)
    time.sleep(120)
"""


@pytest.mark.slow
def test_the_engine_process_exits_when_its_frontend_dies(tiny_llama_with_tokenizer, tmp_path):
    """A server killed outright (no shutdown) must not leave its engine holding the device."""
    script = tmp_path / "frontend.py"
    script.write_text(FRONTEND)
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, str(script), tiny_llama_with_tokenizer]
    frontend = subprocess.Popen(command, stdout=subprocess.PIPE, env=env)
    try:
        engine_pid = int(frontend.stdout.readline())
    finally:
        frontend.kill()
        frontend.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{engine_pid}/stat").read_text().split()[2] == "Z":
                return  # exited; its parent is gone, so nobody reaped it yet
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(engine_pid, signal.SIGKILL)
    pytest.fail("the engine process outlived its frontend by 20 s")


@pytest.mark.slow
def test_a_stopped_engine_neither_freezes_the_event_loop_nor_looks_responsive(tiny_llama_with_tokenizer):
    """SIGSTOP: adds keep going into the (filling) pipe without blocking the loop, and the engine
    turns unresponsive once no heartbeat came for heartbeat_timeout_s; SIGCONT: it serves them all."""

    async def body() -> None:
        engine = AsyncLLMEngine.in_engine_process(engine_args(tiny_llama_with_tokenizer))
        engine.heartbeat_timeout_s = 2.0
        engine.start()
        pid = engine._core.process.pid
        try:
            await asyncio.sleep(1.5)  # idle: heartbeats alone keep it responsive
            assert engine.is_responsive
            os.kill(pid, signal.SIGSTOP)
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            # Far more than a pipe's buffer in all (prompts that fit max_model_len, so that the
            # frontend sends them), so a send on the loop would block.
            adds = [
                asyncio.ensure_future(
                    engine.add_request(f"r{i}", prompt_token_ids=[1] * 240, sampling_params=params)
                )
                for i in range(400)
            ]
            gaps = []
            start = time.monotonic()
            while time.monotonic() - start < 3.5:
                before = time.monotonic()
                await asyncio.sleep(0.05)
                gaps.append(time.monotonic() - before)
            assert max(gaps) < 0.5, max(gaps)
            assert engine.is_healthy and not engine.is_responsive
            os.kill(pid, signal.SIGCONT)
            # Every add queued while it was stopped is answered once it goes on.
            results = await asyncio.wait_for(asyncio.gather(*adds, return_exceptions=True), TIMEOUT_S)
            assert not any(isinstance(result, AsyncEngineDeadError) for result in results), results
            engine.abort([f"r{i}" for i in range(len(adds))])
            assert engine.is_responsive
            stream = await engine.add_request("after", prompt_token_ids=[1, 2, 3], sampling_params=params)
            outputs = [output async for output in stream]
            assert outputs[-1].finished
        finally:
            os.kill(pid, signal.SIGCONT)
            await engine.shutdown()

    run(body())
