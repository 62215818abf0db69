"""Adapters are read off the step's thread (lora/loader.py): while an adapter loads, other
requests keep stepping; its requests then run with it (PEFT's merged model's tokens); an adapter
that fails to load fails only its own requests, with an error naming its path."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
from transformers import LlamaConfig

import pagedllm.lora.loader as loader_module
from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.lora.request import LoRARequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def base(make_tiny_model_for_module):
    return make_tiny_model_for_module(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture
def held_loads(monkeypatch):
    """Every adapter load waits, on the loader thread, until the returned event is set."""
    release = threading.Event()
    real_load = loader_module.load_adapter

    def held_load(*args, **kwargs):
        assert threading.current_thread() is not threading.main_thread(), "loaded on the step's thread"
        release.wait(timeout=60)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(loader_module, "load_adapter", held_load)
    yield release
    release.set()


def new_engine(base) -> LLMEngine:
    args = EngineArgs(model=base[1].model, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8)
    return LLMEngine.from_engine_args(args)


def run_until(engine: LLMEngine, done: set[str], finished: dict, max_steps: int = 200) -> list[float]:
    """Step until every id in ``done`` finished; returns each step's seconds."""
    durations = []
    for _ in range(max_steps):
        if done <= finished.keys():
            return durations
        start = time.perf_counter()
        outputs = engine.step()
        durations.append(time.perf_counter() - start)
        finished.update({o.request_id: o for o in outputs if o.finished})
    raise AssertionError(f"not finished after {max_steps} steps: {done - finished.keys()}")


def test_a_slow_adapter_load_does_not_hold_back_other_requests(
    base, make_adapter, make_prompts, held_loads, peft_merged, hf_greedy_tokens
):
    engine = new_engine(base)
    lora = LoRARequest("slow", 1, make_adapter(base[0], 4, ["q_proj", "down_proj"]))
    prompts = make_prompts(2, base[1].vocab_size, seed=3)
    engine.add_request("adapter", prompt_token_ids=prompts[0], sampling_params=GREEDY, lora_request=lora)
    engine.add_request("base", prompt_token_ids=prompts[1], sampling_params=GREEDY)

    finished: dict = {}
    durations = run_until(engine, {"base"}, finished)
    # The base request ran to its end while the load was held; no step waited for it.
    assert "adapter" not in finished and max(durations) < 5.0
    assert engine.engine_core.scheduler.queues.requests.keys().isdisjoint(
        {r.req_id for r in engine.engine_core.requests["adapter"].group.members}
    )
    held_loads.set()
    run_until(engine, {"adapter"}, finished)
    merged = peft_merged(base[0], lora.lora_path)
    assert finished["adapter"].outputs[0].token_ids == hf_greedy_tokens(merged, prompts[0], GREEDY.max_tokens)
    assert finished["base"].outputs[0].token_ids == hf_greedy_tokens(base[0], prompts[1], GREEDY.max_tokens)


def test_an_adapter_that_fails_to_load_fails_only_its_requests(
    base, make_adapter, make_prompts, held_loads, peft_merged, hf_greedy_tokens
):
    engine = new_engine(base)
    good = LoRARequest("good", 1, make_adapter(base[0], 8, ["v_proj", "gate_proj"]))
    bad = LoRARequest("bad", 2, make_adapter(base[0], 4, ["k_proj"]))
    prompts = make_prompts(4, base[1].vocab_size, seed=8)
    choices = {"bad-1": bad, "good": good, "base": None, "bad-2": bad}
    for (request_id, lora), prompt in zip(choices.items(), prompts):
        engine.add_request(request_id, prompt_token_ids=prompt, sampling_params=GREEDY, lora_request=lora)
    # Checked when added, gone by the time its load reads it (held until now).
    shutil.rmtree(bad.lora_path)
    held_loads.set()

    finished: dict = {}
    run_until(engine, set(choices), finished)
    for request_id in ("bad-1", "bad-2"):
        output = finished[request_id]
        assert output.outputs[0].finish_reason == "error" and output.outputs[0].token_ids == []
        assert bad.lora_path in output.error and "'bad'" in output.error
    merged = peft_merged(base[0], good.lora_path)
    assert finished["good"].error is None and finished["base"].error is None
    assert finished["good"].outputs[0].token_ids == hf_greedy_tokens(merged, prompts[1], GREEDY.max_tokens)
    assert finished["base"].outputs[0].token_ids == hf_greedy_tokens(base[0], prompts[2], GREEDY.max_tokens)
    # The engine goes on serving the good adapter.
    engine.add_request("again", prompt_token_ids=prompts[3], sampling_params=GREEDY, lora_request=good)
    run_until(engine, {"again"}, finished)
    assert finished["again"].outputs[0].token_ids == hf_greedy_tokens(merged, prompts[3], GREEDY.max_tokens)


def test_the_host_lru_keeps_every_adapter_whose_requests_wait(base, make_adapter):
    """max_cpu_loras=1 and three adapters loading at once: each is reported on the host (none
    dropped by the others' arrival while its requests wait), and the LRU shrinks back after."""
    from pagedllm.lora.config import LoRAConfig

    loader = loader_module.AdapterLoader(base[1].hf_config, LoRAConfig(max_loras=1, max_cpu_loras=1))
    loras = [LoRARequest(f"a{i}", i + 1, make_adapter(base[0], 2, ["q_proj"])) for i in range(3)]
    for lora in loras:
        loader.start(lora)
    ids, loaded = {1, 2, 3}, set()
    for _ in range(500):
        loaded, failed = loader.states(ids, timeout=0.1)
        assert not failed
        if loaded == ids:
            break
    assert loaded == ids
    num_layers = base[1].hf_config.num_hidden_layers
    assert loader.get(2).weights.keys() == {(layer, "q_proj") for layer in range(num_layers)}
    # Once no request waits for them, the next adapter's arrival takes the LRU back to one.
    loader.start(LoRARequest("a4", 4, make_adapter(base[0], 2, ["k_proj"])))
    loader.get(4)
    assert loader.states([1, 2, 3, 4])[0] == {4}
    loader.shutdown()
