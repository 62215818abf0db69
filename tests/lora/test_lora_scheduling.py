"""Adapters under the engine's limits: more adapters than slots (max_loras) queue and take turns,
adapters leave the host LRU (max_cpu_loras) and come back, and the prefix cache never hands one
adapter's KV blocks to another; every output stays PEFT's merged model's."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def base(make_tiny_model_for_module):
    return make_tiny_model_for_module(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture
def adapters(base, make_adapter):
    targets = [["q_proj", "k_proj"], ["o_proj", "down_proj"], ["v_proj", "gate_proj", "up_proj"]]
    return [LoRARequest(f"a{i}", i + 1, make_adapter(base[0], 2 + 2 * i, t)) for i, t in enumerate(targets)]


def expected_outputs(base, prompts, choices, peft_merged, hf_greedy_tokens):
    merged = {}
    for lora in {c for c in choices if c is not None}:
        merged[lora.lora_int_id] = peft_merged(base[0], lora.lora_path)
    return [
        hf_greedy_tokens(merged[c.lora_int_id] if c else base[0], p, GREEDY.max_tokens)
        for p, c in zip(prompts, choices)
    ]


def test_more_adapters_than_slots_wait_their_turn(
    base, adapters, make_prompts, peft_merged, hf_greedy_tokens
):
    llm = LLM(base[1].model, device="cpu", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    scheduler = llm.llm_engine.scheduler
    per_step: list[set[int]] = []
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        ids = {r.group.lora_int_id for r in scheduler.running if r.req_id in out.num_scheduled_tokens}
        per_step.append(ids - {0})
        return out

    scheduler.schedule = recording_schedule
    choices = [adapters[0], adapters[1], None, adapters[2], adapters[0], adapters[1], None]
    prompts = make_prompts(len(choices), base[1].vocab_size, seed=5)
    outputs = llm.generate(
        prompt_token_ids=prompts, sampling_params=GREEDY, lora_request=choices, use_tqdm=False
    )

    assert max(len(ids) for ids in per_step) == 1
    # Each adapter ran; the first and second took turns, so the slot and the host cache refilled.
    assert {i for ids in per_step for i in ids} == {1, 2, 3}
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == expected_outputs(base, prompts, choices, peft_merged, hf_greedy_tokens)


def test_prefix_cache_is_kept_apart_per_adapter(base, adapters, make_prompts, peft_merged, hf_greedy_tokens):
    llm = LLM(
        base[1].model, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
        enable_prefix_caching=True, block_size=4,
    )  # fmt: skip
    prompt = make_prompts(1, base[1].vocab_size, seed=9, lo=20, hi=20)[0]
    # The same prompt under adapter 0, adapter 1, the base model, adapter 0 again: a shared block
    # between any two of the first three would give the later one the earlier one's K/V.
    choices = [adapters[0], adapters[1], None, adapters[0]]
    got = []
    for lora in choices:
        output = llm.generate(
            prompt_token_ids=[prompt], sampling_params=GREEDY, lora_request=lora, use_tqdm=False
        )
        got.append(output[0].outputs[0].token_ids)
        if lora is choices[0] and len(got) == 1:
            assert llm.llm_engine.get_stats().prefix_cache_hit_rate == 0.0
    expected = expected_outputs(base, [prompt] * 4, choices, peft_merged, hf_greedy_tokens)
    assert got == expected
    assert len({tuple(tokens) for tokens in got[:3]}) == 3
    # Only the repeat of adapter 0 found blocks: 4 full blocks of 20 prompt tokens (the last
    # token is always computed) out of the 80 looked up.
    assert llm.llm_engine.get_stats().prefix_cache_hit_rate == pytest.approx(16 / 80)
