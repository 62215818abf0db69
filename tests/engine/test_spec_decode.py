"""Speculative decoding (n-gram drafts) end to end on the CPU, float32: greedy outputs are token
for token those of decoding without it and of HF ``generate``; sampled outputs follow the
target's exact distribution; bad configurations are refused before anything is loaded."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from pagedllm import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}

# The architectures of tests/engine/test_generation.py's HF-equality cases.
MODEL_CASES = {
    "llama-mha-tied": (
        LlamaConfig,
        {"num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": True},
    ),
    "llama-gqa2-head64": (LlamaConfig, {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}),
    "mistral-gqa4-head128": (
        MistralConfig,
        {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "sliding_window": None},
    ),
    "qwen2-bias": (Qwen2Config, {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "qwen3-qknorm-head64": (
        Qwen3Config,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64},
    ),
    "qwen3moe-top8": (
        Qwen3MoeConfig,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_experts": 16,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 32,
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


def mixed_prompts(n: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Half repetitive (a short motif repeated: n-gram drafts find matches and some are
    accepted), half random (few matches), of ragged lengths."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 2 == 0:
            motif = [rng.randrange(vocab_size) for _ in range(rng.randint(2, 6))]
            prompts.append((motif * 20)[: rng.randint(8, 40)])
        else:
            prompts.append([rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))])
    return prompts


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


def make_llm(model_config, **kwargs) -> LLM:
    return LLM(model_config.model, device="cpu", **kwargs)


def assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.llm_engine.scheduler.kv_cache_manager
    assert kv.get_num_free_gpu_blocks() == kv.num_total_gpu_blocks
    assert kv.get_num_requests_with_blocks() == 0


@pytest.fixture
def tiny_llama(make_tiny_model):
    return make_tiny_model(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_greedy_with_ngram_equals_hf_and_decoding_without_it(make_tiny_model, case):
    config_class, overrides = MODEL_CASES[case]
    hf_model, model_config = make_tiny_model(config_class, **overrides)
    prompts = mixed_prompts(6, model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = make_llm(model_config, block_size=4, speculative_config=NGRAM)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(outputs) == hf_greedy(hf_model, prompts, 16)
    spec = llm.llm_engine.scheduler.spec_decoding
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0, "the test must verify drafts"
    assert_all_blocks_free(llm)


def test_preemption_and_prefix_caching_with_ngram_change_no_output(tiny_llama):
    _, model_config = tiny_llama
    shared = mixed_prompts(1, model_config.vocab_size, seed=3)[0][:12]
    prompts = [shared + p for p in mixed_prompts(8, model_config.vocab_size, seed=1)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = make_llm(model_config, block_size=4)
    expected = token_ids(roomy.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    # 40 blocks of 4 tokens: less than the 8 requests need at once; drafts need more slots still.
    tight = make_llm(
        model_config,
        block_size=4,
        num_kv_blocks=40,
        max_model_len=96,
        swap_space=0.01,
        enable_prefix_caching=True,
        speculative_config=NGRAM,
    )
    outputs = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(outputs) == expected
    stats = tight.llm_engine.get_stats()
    assert stats.num_preemptions_recompute > 0
    assert stats.prefix_cache_hit_rate > 0
    assert tight.llm_engine.scheduler.spec_decoding.num_accepted_tokens > 0
    # Again, now that the prefix cache holds the first run's blocks (registered from accepted
    # tokens only): the same outputs.
    again = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(again) == expected
    assert_all_blocks_free(tight)


def test_chunked_prefill_and_a_small_token_budget_with_ngram_change_no_output(tiny_llama):
    _, model_config = tiny_llama
    prompts = mixed_prompts(6, model_config.vocab_size, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = make_llm(model_config, block_size=4)
    expected = token_ids(plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    llm = make_llm(
        model_config,
        block_size=4,
        enable_chunked_prefill=True,
        max_num_batched_tokens=12,
        max_num_seqs=4,
        speculative_config=NGRAM,
    )
    assert (
        token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)) == expected
    )
    assert_all_blocks_free(llm)


def test_lengths_stop_tokens_min_tokens_and_logprobs_hold_with_ngram(tiny_llama):
    """Drafts are cut at max_tokens and the context; a stop token inside an accepted run ends the
    request there; min_tokens bans EOS at every verified position; logprobs are the emitted
    tokens'."""
    _, model_config = tiny_llama
    prompts = mixed_prompts(6, model_config.vocab_size, seed=4)
    prompts[1] = ([7, 8, 9] * 10)[:30]  # 30 + 30 tokens pass max_model_len
    plain = make_llm(model_config, block_size=4, max_model_len=48)
    spec = make_llm(model_config, block_size=4, max_model_len=48, speculative_config=NGRAM)
    free_run = token_ids(
        plain.generate(
            prompt_token_ids=prompts,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
            use_tqdm=False,
        )
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),  # reaches max_model_len
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[free_run[2][6]], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[free_run[3][1]], min_tokens=8),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=0, ignore_eos=True),
    ]
    want = plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    got = spec.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert len(got[0].outputs[0].token_ids) == 5
    assert len(prompts[1]) + len(got[1].outputs[0].token_ids) == 48
    for g, w in zip(got[4:], want[4:]):
        assert len(g.outputs[0].logprobs) == len(w.outputs[0].logprobs)
        for g_pos, w_pos in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert g_pos.keys() == w_pos.keys()
            for token in g_pos:
                assert g_pos[token].logprob == pytest.approx(w_pos[token].logprob, abs=1e-4)
                assert g_pos[token].rank == w_pos[token].rank
    assert spec.llm_engine.scheduler.spec_decoding.num_accepted_tokens > 0
    assert_all_blocks_free(spec)


def test_acceptance_is_counted_per_request_and_engine_wide(tiny_llama):
    _, model_config = tiny_llama
    prompts = mixed_prompts(6, model_config.vocab_size, seed=5)
    llm = make_llm(model_config, block_size=4, speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    spec = llm.llm_engine.scheduler.spec_decoding
    assert sum(o.metrics.spec_num_draft_tokens for o in outputs) == spec.num_draft_tokens
    assert sum(o.metrics.spec_num_accepted_tokens for o in outputs) == spec.num_accepted_tokens
    assert sum(spec.num_accepted_tokens_per_pos) == spec.num_accepted_tokens
    # Position i is accepted only after every position before it.
    per_pos = spec.num_accepted_tokens_per_pos
    assert all(a >= b for a, b in itertools.pairwise(per_pos))
    # Each verification emits its accepted drafts and one token; the first token of each request
    # comes from its prompt, and steps without drafts give one each.
    num_outputs = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_outputs - len(outputs) >= spec.num_drafts + spec.num_accepted_tokens
    for o in outputs:
        rate = o.metrics.spec_acceptance_rate
        assert rate is None or 0.0 <= rate <= 1.0


@pytest.mark.parametrize(
    "config, field",
    [
        ({"method": "eagle7"}, "speculative_config.method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
        (
            {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_max",
        ),
        ({"method": "ngram", "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
        ({"method": "ngram", "speculative_tokens": 3}, "unknown keys ['speculative_tokens']"),
        ({"num_speculative_tokens": 3}, "speculative_config.method is required"),
        ({"method": "draft_model", "model": "/some/model"}, "speculative_config.model"),
        ({"method": "eagle3"}, "speculative_config.method 'eagle3' is not supported yet"),
        ('{"method": "ngram", ', "speculative_config must be a JSON object"),
    ],
)
def test_bad_speculative_configs_are_refused_before_loading(config, field):
    # The model does not exist: the config is checked before anything is read.
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        LLM("/nonexistent/model", device="cpu", speculative_config=config)


def test_speculation_turns_async_scheduling_off_and_refuses_it_explicitly(tiny_llama):
    _, model_config = tiny_llama
    with pytest.raises(ValueError, match="async_scheduling"):
        make_llm(model_config, speculative_config=NGRAM, async_scheduling=True)
