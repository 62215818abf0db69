"""End to end on the CPU: greedy outputs equal Hugging Face's, under every scheduling condition.

Tiny random models of each supported architecture are saved with ``save_pretrained`` and run
through ``LLM``; HF ``generate`` on the same weights is the reference, token for token, float32.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from pagedllm import LLM, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine

MODEL_CASES = {
    # name: (config class, overrides): GQA ratios 1, 2, 4 and MQA; head sizes 16, 64, 128; tied and untied.
    "llama-mha-tied": (
        LlamaConfig,
        {"num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": True},
    ),
    "llama-gqa2-head64": (
        LlamaConfig,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": False},
    ),
    "llama3-rope-scaling": (
        LlamaConfig,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "mistral-gqa4-head128": (
        MistralConfig,
        {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "sliding_window": None},
    ),
    "qwen2-bias": (
        Qwen2Config,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False},
    ),
    "qwen3-qknorm-head64": (
        Qwen3Config,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": True},
    ),
    # Mixtures of experts: a dense first layer and top-8 of 16 renormalised; Mixtral's top-2 of 4.
    "qwen3moe-top8-mlp-only-layer": (
        Qwen3MoeConfig,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_experts": 16,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
    "mixtral-top2": (
        MixtralConfig,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
}

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def ragged_prompts(n: int, vocab_size: int, seed: int = 0, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def hf_greedy(hf_model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    hf_model.generation_config.eos_token_id = None
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        ids = hf_model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_free(engine: LLMEngine) -> None:
    bm = engine.scheduler.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    assert bm.get_num_requests_with_blocks() == 0


def make_llm(model_config, **kwargs) -> LLM:
    return LLM(model_config.model, device="cpu", **kwargs)


@pytest.fixture
def tiny_llama(make_tiny_model):
    return make_tiny_model(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_greedy_equals_hf_on_a_ragged_batch(make_tiny_model, case):
    config_class, overrides = MODEL_CASES[case]
    hf_model, model_config = make_tiny_model(config_class, **overrides)
    prompts = ragged_prompts(6, model_config.vocab_size)
    llm = make_llm(model_config, block_size=8)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert token_ids(outputs) == hf_greedy(hf_model, prompts, GREEDY.max_tokens)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert_all_blocks_free(llm.llm_engine)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.slow
def test_greedy_equals_hf_for_other_block_sizes(tiny_llama, block_size):
    hf_model, model_config = tiny_llama
    prompts = ragged_prompts(4, model_config.vocab_size, seed=block_size)
    llm = make_llm(model_config, block_size=block_size)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert token_ids(outputs) == hf_greedy(hf_model, prompts, GREEDY.max_tokens)


def test_preemption_by_recompute_and_swap_changes_no_output(tiny_llama):
    hf_model, model_config = tiny_llama
    prompts = ragged_prompts(8, model_config.vocab_size, seed=1, lo=8, hi=24)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    params = [greedy if i % 2 == 0 else sampled for i in range(len(prompts))]

    roomy = make_llm(model_config, block_size=4)
    expected = roomy.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    # 32 blocks of 4 tokens: far less than the 8 requests need at once (about 8 x 2 x 12 blocks).
    tight = make_llm(model_config, block_size=4, num_kv_blocks=32, max_model_len=64, swap_space=0.01)
    outputs = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)

    stats = tight.llm_engine.get_stats()
    assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap > 0
    for got, want in zip(outputs, expected):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    greedy_prompts = prompts[::2]
    assert [o.outputs[0].token_ids for o in outputs[::2]] == hf_greedy(hf_model, greedy_prompts, 24)
    assert_all_blocks_free(tight.llm_engine)


@pytest.mark.parametrize("max_num_batched_tokens, chunked", [(64, False), (16, True), (64, True)])
def test_token_budget_makes_prompts_wait_without_changing_outputs(
    tiny_llama, max_num_batched_tokens, chunked
):
    hf_model, model_config = tiny_llama
    prompts = ragged_prompts(6, model_config.vocab_size, seed=2, lo=20, hi=40)
    llm = make_llm(
        model_config,
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=chunked,
    )
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), sampling_params=GREEDY, prompt_token_ids=prompt)
    max_waiting = 0
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
        max_waiting = max(max_waiting, len(engine.scheduler.waiting))
    assert max_waiting > 0, "the budget never made a prompt wait"
    got = [outputs[str(i)].outputs[0].token_ids for i in range(len(prompts))]
    assert got == hf_greedy(hf_model, prompts, GREEDY.max_tokens)
    assert_all_blocks_free(engine)


def test_outputs_do_not_depend_on_the_rest_of_the_batch(tiny_llama):
    _, model_config = tiny_llama
    prompts = ragged_prompts(9, model_config.vocab_size, seed=3)
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=11, max_tokens=16, ignore_eos=True),
        SamplingParams(n=3, temperature=1.2, min_p=0.05, seed=12, max_tokens=16, ignore_eos=True),
    ]
    llm = make_llm(model_config)
    alone = [
        llm.generate(prompt_token_ids=[prompts[i]], sampling_params=params[i], use_tqdm=False)[0]
        for i in range(3)
    ]
    others = [SamplingParams(temperature=1.0, max_tokens=10 + i) for i in range(6)]
    together = llm.generate(prompt_token_ids=prompts, sampling_params=params + others, use_tqdm=False)
    for got, want in zip(together[:3], alone):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert_all_blocks_free(llm.llm_engine)


def test_parallel_samples_share_the_prompt_blocks(tiny_llama):
    _, model_config = tiny_llama
    llm = make_llm(model_config, block_size=4)
    engine = llm.llm_engine
    prompt = ragged_prompts(1, model_config.vocab_size, seed=4, lo=18, hi=18)[0]
    engine.add_request(
        "0", sampling_params=SamplingParams(n=4, temperature=1.0, max_tokens=8), prompt_token_ids=prompt
    )
    engine.step()  # prefill and first sample: the request forks into 4 sequences
    group = engine.engine_core.requests["0"].group
    tables = [engine.scheduler.kv_cache_manager.get_block_ids(seq) for seq in group.members]
    assert len(tables) == 4
    num_full_prompt_blocks = len(prompt) // 4
    assert all(t[:num_full_prompt_blocks] == tables[0][:num_full_prompt_blocks] for t in tables)
    used = (
        engine.scheduler.kv_cache_manager.num_total_gpu_blocks
        - engine.scheduler.kv_cache_manager.get_num_free_gpu_blocks()
    )
    assert used == (len(prompt) + 3) // 4, "the prompt's blocks are allocated once"
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


def test_seeded_sampling_is_reproducible_and_n_samples_differ(tiny_llama):
    _, model_config = tiny_llama
    llm = make_llm(model_config)
    prompt = ragged_prompts(1, model_config.vocab_size, seed=5)[0]
    params = SamplingParams(n=4, temperature=1.5, seed=99, max_tokens=12, ignore_eos=True)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    second = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1


def test_eos_and_stop_token_ids_end_generation(tiny_llama):
    _, model_config = tiny_llama
    prompt = ragged_prompts(1, model_config.vocab_size, seed=6)[0]
    llm = make_llm(model_config)
    free_run = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)[0].outputs[0]
    stop_at = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_at)
    out = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == free_run.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens keeps the stop token from being sampled until reached.
    out = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(
            temperature=0.0, max_tokens=12, min_tokens=8, stop_token_ids=[stop_at]
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) >= 8 and stop_at not in out.token_ids[:8]


def test_abort_frees_everything(tiny_llama):
    _, model_config = tiny_llama
    llm = make_llm(model_config, block_size=4, num_kv_blocks=24, max_model_len=48, swap_space=0.01)
    engine = llm.llm_engine
    prompts = ragged_prompts(6, model_config.vocab_size, seed=7, lo=10, hi=20)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(n=1 + i % 2, temperature=1.0, max_tokens=30, ignore_eos=True)
        engine.add_request(str(i), sampling_params=params, prompt_token_ids=prompt)
    for _ in range(8):
        engine.step()
    engine.abort_request([str(i) for i in range(6)])
    assert_all_blocks_free(engine)
    # The engine still serves new requests afterwards.
    out = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_bad_requests_fail_alone(tiny_llama):
    _, model_config = tiny_llama
    llm = make_llm(model_config, max_model_len=32)
    engine = llm.llm_engine
    engine.add_request("ok", sampling_params=GREEDY, prompt_token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", sampling_params=GREEDY, prompt_token_ids=[])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("oov", sampling_params=GREEDY, prompt_token_ids=[1, model_config.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("neg", sampling_params=GREEDY, prompt_token_ids=[-1])
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("text", prompt="hello", sampling_params=GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", sampling_params=GREEDY, prompt_token_ids=[1])
    engine.add_request("long", sampling_params=GREEDY, prompt_token_ids=[1] * 40)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    assert set(outputs) == {"ok", "long"}
    error = outputs["long"].error
    assert outputs["long"].finished and "40 tokens" in error and "max_model_len=32" in error
    assert outputs["ok"].error is None and len(outputs["ok"].outputs[0].token_ids) == GREEDY.max_tokens
    assert_all_blocks_free(engine)


def test_generate_rejects_a_bad_batch_without_keeping_any_of_it(tiny_llama):
    _, model_config = tiny_llama
    llm = make_llm(model_config)
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate(prompt_token_ids=[[1, 2], []], sampling_params=GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(prompt_token_ids=[[1], [2]], sampling_params=[GREEDY] * 3, use_tqdm=False)


def test_engine_arguments_are_checked_at_start(tiny_llama, tmp_path):
    _, model_config = tiny_llama
    with pytest.raises(ValueError, match="not a local directory"):
        LLM(str(tmp_path / "missing"), device="cpu")
    with pytest.raises(ValueError, match="max_model_len must be <= 256"):
        make_llm(model_config, max_model_len=100_000)
    with pytest.raises(ValueError, match="fewer than one sequence of max_model_len"):
        make_llm(model_config, num_kv_blocks=2, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="block_size must be"):
        make_llm(model_config, block_size=12)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        make_llm(model_config, gpu_memory_utilization=1.5)
