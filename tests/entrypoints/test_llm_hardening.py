"""The Python API under misuse: interrupted generate, abort, wrong tokenizer path, corrupt weights."""

from __future__ import annotations

import shutil
import threading

import pytest

from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir) -> str:
    return tiny_llama_dir


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, device="cpu", max_model_len=64, num_kv_blocks=16)


def _all_blocks_free(llm: LLM) -> bool:
    engine = llm.llm_engine
    return engine.scheduler.kv_cache_manager.get_num_free_gpu_blocks() == engine.num_gpu_blocks


def test_an_interrupted_generate_leaves_nothing_queued(llm, monkeypatch):
    engine = llm.llm_engine
    real_step = engine.step
    calls = []

    def step_then_interrupt():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", step_then_interrupt)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5]], sampling_params=params, use_tqdm=False)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests() and _all_blocks_free(llm)
    [output] = llm.generate(
        prompt_token_ids=[1, 2], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False
    )
    assert len(output.outputs[0].token_ids) == 2


def test_a_request_that_fails_the_model_step_comes_back_failed_beside_the_others(model_dir):
    llm = LLM(model_dir, device="cpu", attention_backend="torch", max_model_len=64, num_kv_blocks=32)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    engine = llm.llm_engine
    execute_model = engine.executor.execute_model

    def fail_steps_of_the_third_prompt(scheduler_output):
        scheduled = [engine.scheduler.requests[r] for r in scheduler_output.num_scheduled_tokens]
        if any(request.prompt_token_ids == prompts[2] for request in scheduled):
            raise RuntimeError("injected step failure")
        return execute_model(scheduler_output)

    engine.executor.execute_model = fail_steps_of_the_third_prompt
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    engine.executor.execute_model = execute_model
    assert [o.prompt_token_ids for o in outputs] == prompts
    failed = outputs[2]
    assert failed.finished and failed.failed and "injected step failure" in failed.error
    assert [c.finish_reason for c in failed.outputs] == ["error"]
    for i in (0, 1, 3):
        assert not outputs[i].failed and outputs[i].outputs[0].token_ids == expected[i].outputs[0].token_ids
    assert not engine.has_unfinished_requests() and _all_blocks_free(llm)
    again = llm.generate(prompt_token_ids=prompts[2], sampling_params=params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == expected[2].outputs[0].token_ids


def test_abort_ends_requests_and_frees_their_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("a", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=30))
    engine.add_request("b", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=30))
    engine.step()
    llm.abort("a")
    assert set(engine.requests) == {"b"}
    llm.abort_all()
    assert not engine.has_unfinished_requests() and _all_blocks_free(llm)


def test_an_abort_from_another_thread_lands_between_steps_and_generate_returns_every_output(llm):
    """Another thread aborts one request of a running generate() while a step is in progress:
    the abort waits for no lock and never runs inside the step; generate() returns every prompt's
    output, the aborted one cut short with finish reason "abort", the others as in a run without
    the abort; every block is free."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1 + i, 2, 3, 4]} for i in range(4)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = llm.llm_engine
    real_step = engine.step
    steps = []

    def step_with_an_abort_during_it():
        steps.append(1)
        if len(steps) == 3:
            victim = sorted(engine.requests, key=int)[1]
            aborter = threading.Thread(target=llm.abort, args=(victim,))
            aborter.start()
            aborter.join(timeout=10)  # it returns while this step still holds the engine
            assert not aborter.is_alive() and victim in engine.requests
        return real_step()

    engine.step = step_with_an_abort_during_it
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del engine.step
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "abort", "length", "length"]
    assert 0 < len(outputs[1].outputs[0].token_ids) < 24
    assert outputs[1].outputs[0].token_ids == expected[1][: len(outputs[1].outputs[0].token_ids)]
    assert [outputs[i].outputs[0].token_ids for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]
    assert not engine.has_unfinished_requests() and _all_blocks_free(llm)


def test_ctrl_c_while_prompts_are_added_leaves_nothing_queued(llm, monkeypatch):
    engine = llm.llm_engine
    real_add = engine.add_request
    calls = []

    def add_then_interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_add(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", add_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 5, SamplingParams(max_tokens=4), use_tqdm=False)
    assert not engine.has_unfinished_requests() and _all_blocks_free(llm)


def test_a_wrong_tokenizer_path_is_refused_at_start(model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer .* is not a directory with tokenizer files"):
        LLM(model_dir, tokenizer=str(tmp_path / "missing"), device="cpu", max_model_len=64, num_kv_blocks=16)


def test_a_corrupt_safetensors_file_is_named(model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        LLM(str(broken), device="cpu", max_model_len=64, num_kv_blocks=16)


def test_a_corrupt_gguf_file_is_named(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ValueError, match=r"broken\.gguf"):
        LLM(str(path), device="cpu")


def test_prompts_of_the_wrong_type_name_the_argument(llm):
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate(prompts=42, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        llm.generate(prompt_token_ids=[1], sampling_params=[{"temperature": 0}], use_tqdm=False)
