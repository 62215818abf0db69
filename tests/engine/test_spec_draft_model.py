"""Speculative decoding with a draft model (``method="draft_model"``) end to end on the CPU,
float32: greedy outputs are token for token HF ``generate``'s and those of decoding without
speculation, whatever the draft (the target itself, a perturbed copy, another family); the
target as its own draft is accepted every time, which holds only if the draft's KV cache on the
target's block tables is right through chunked prefill, prefix caching and preemption; sampled
outputs follow the target's exact distribution; bad configurations are refused before loading."""

from __future__ import annotations

import pytest
import torch
from test_spec_decode import (
    SAMPLED_CASES,
    TIGHT,
    assert_all_blocks_free,
    exact_joint,
    make_llm,
    mixed_prompts,
    pair_p_value,
    token_ids,
)
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from pagedllm import LLM, SamplingParams
from pagedllm.spec_config import SpeculativeConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def draft_config(path: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def perturbed_copy(hf_model, directory, scale: float) -> str:
    """The target's weights plus noise: a draft that agrees with it often but not always."""
    draft = AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32)
    draft.load_state_dict(hf_model.state_dict())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(scale * param.abs().mean() * torch.randn(param.shape, generator=generator))
    draft.save_pretrained(directory)
    return str(directory)


def spec(llm: LLM):
    return llm.llm_engine.scheduler.spec_decoding


@pytest.fixture(scope="module")
def target(make_tiny_model_for_module):
    return make_tiny_model_for_module(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def drafts(target, make_tiny_model_for_module, tmp_path_factory):
    """name -> draft model directory: the target itself, a perturbed copy, and a one-layer Qwen2
    (another family, other head sizes) with the target's vocabulary."""
    hf_model, model_config = target
    _, qwen2 = make_tiny_model_for_module(
        Qwen2Config,
        vocab_size=model_config.vocab_size,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return {
        "self": model_config.model,
        "perturbed": perturbed_copy(hf_model, tmp_path_factory.mktemp("perturbed"), 0.3),
        "qwen2-1-layer": qwen2.model,
    }


@pytest.mark.parametrize("name", ["self", "perturbed", "qwen2-1-layer"])
def test_greedy_with_a_draft_model_equals_hf_and_decoding_without_it(target, drafts, hf_greedy_tokens, name):
    hf_model, model_config = target
    prompts = mixed_prompts(6, model_config.vocab_size)
    llm = make_llm(model_config, block_size=4, speculative_config=draft_config(drafts[name]))
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert token_ids(outputs) == [hf_greedy_tokens(hf_model, prompt, 16) for prompt in prompts]
    counters = spec(llm)
    assert counters.num_draft_tokens > 0, "the test must verify drafts"
    if name == "self":
        assert counters.num_accepted_tokens == counters.num_draft_tokens  # acceptance 1.0
    if name == "perturbed":
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert_all_blocks_free(llm)


@pytest.mark.slow
def test_the_target_as_its_own_draft_is_always_accepted_through_preemption_prefix_caching_and_chunks(
    target, drafts
):
    """Acceptance 1.0 needs the draft's KV of every earlier token: prompt chunks, prefix cache
    hits (the draft's K/V beside the target's in the shared blocks), recomputed requests."""
    _, model_config = target
    shared = mixed_prompts(1, model_config.vocab_size, seed=3)[0][:12]
    prompts = [shared + p for p in mixed_prompts(8, model_config.vocab_size, seed=1)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = make_llm(model_config, block_size=4)
    expected = token_ids(plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    tight = make_llm(
        model_config,
        **TIGHT,
        speculative_config=draft_config(drafts["self"]),
    )
    for _ in range(2):  # the second run finds the first one's blocks in the prefix cache
        outputs = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert token_ids(outputs) == expected
    stats = tight.llm_engine.get_stats()
    assert stats.num_preemptions_recompute > 0
    assert stats.prefix_cache_hit_rate > 0
    counters = spec(tight)
    assert counters.num_draft_tokens > 0
    assert counters.num_accepted_tokens == counters.num_draft_tokens
    assert_all_blocks_free(tight)


@pytest.mark.slow
def test_a_perturbed_draft_changes_no_output_under_preemption_and_prefix_caching(target, drafts):
    _, model_config = target
    prompts = mixed_prompts(8, model_config.vocab_size, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = make_llm(model_config, block_size=4)
    expected = token_ids(plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    tight = make_llm(
        model_config,
        block_size=4,
        num_kv_blocks=40,
        max_model_len=96,
        enable_prefix_caching=True,
        speculative_config=draft_config(drafts["perturbed"], k=4),
    )
    outputs = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(outputs) == expected
    assert tight.llm_engine.get_stats().num_preemptions_recompute > 0
    assert 0 < spec(tight).num_accepted_tokens < spec(tight).num_draft_tokens
    assert_all_blocks_free(tight)


@pytest.mark.slow
def test_drafts_are_cut_at_max_tokens_and_max_model_len(target, drafts):
    _, model_config = target
    prompts = mixed_prompts(4, model_config.vocab_size, seed=4)
    prompts[1] = ([7, 8, 9] * 10)[:30]  # 30 + 30 tokens pass max_model_len
    params = [
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
    ]
    plain = make_llm(model_config, block_size=4, max_model_len=48)
    llm = make_llm(
        model_config, block_size=4, max_model_len=48, speculative_config=draft_config(drafts["self"], k=5)
    )
    want = plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert [len(t) for t in token_ids(got)] == [5, 18, 20, 3]
    for g_pos, w_pos in zip(got[2].outputs[0].logprobs, want[2].outputs[0].logprobs):
        assert g_pos.keys() == w_pos.keys()
    assert spec(llm).num_accepted_tokens == spec(llm).num_draft_tokens > 0
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def tiny_vocab(make_tiny_model_for_module, tmp_path_factory):
    """Eight tokens (every sequence of four outputs enumerable) and a perturbed draft of it."""
    hf_model, model_config = make_tiny_model_for_module(
        LlamaConfig, vocab_size=8, num_attention_heads=4, num_key_value_heads=2
    )
    return hf_model, model_config, perturbed_copy(hf_model, tmp_path_factory.mktemp("draft8"), 0.5)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SAMPLED_CASES))
def test_sampled_outputs_follow_the_target_distribution_with_a_draft_model(tiny_vocab, case):
    hf_model, model_config, draft = tiny_vocab
    params = SAMPLED_CASES[case]
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 5, 6]
    joint = exact_joint(hf_model, prompt, params, 4)
    llm = make_llm(model_config, block_size=4, max_num_seqs=256, speculative_config=draft_config(draft))
    outputs = llm.generate(prompt_token_ids=[prompt] * 3000, sampling_params=params, use_tqdm=False)
    samples = [tuple(o.outputs[0].token_ids) for o in outputs]
    for first in range(3):
        assert pair_p_value(samples, joint, first) > 1e-3, first
    counters = spec(llm)
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert counters.num_accepted_tokens_per_pos[1] > 0


# --- configuration ------------------------------------------------------------------------------


def test_vllm_older_spelling_a_model_without_method_is_a_draft_model():
    config = SpeculativeConfig.from_dict({"model": "/some/draft", "num_speculative_tokens": 2})
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "/some/draft", 2)
    assert SpeculativeConfig.from_dict({"model": "[ngram]"}).method == "ngram"


@pytest.mark.parametrize(
    "config, field",
    [
        ({"method": "draft_model"}, "speculative_config.model"),
        ({"method": "ngram", "model": "/some/draft"}, "speculative_config.model"),
        ({"method": "draft_model", "model": "/d", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "draft_model", "model": "/d", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ],
)
def test_bad_draft_configs_are_refused_before_anything_is_read(config, field):
    with pytest.raises(ValueError, match=field):
        LLM("/nonexistent/model", device="cpu", speculative_config=config)


def test_a_draft_the_engine_cannot_run_beside_the_target_is_refused_before_loading(
    target, make_tiny_model, drafts, monkeypatch
):
    _, model_config = target
    _, other_vocab = make_tiny_model(LlamaConfig, vocab_size=model_config.vocab_size + 1)
    _, short = make_tiny_model(LlamaConfig, max_position_embeddings=64)

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were read before the config was refused")

    monkeypatch.setattr("pagedllm.model_loader.get_model", no_loading)
    with pytest.raises(ValueError, match=r"speculative_config.model .* vocabulary"):
        make_llm(model_config, speculative_config=draft_config(other_vocab.model))
    with pytest.raises(ValueError, match=r"speculative_config.model .* max_model_len 64"):
        make_llm(model_config, max_model_len=128, speculative_config=draft_config(short.model))
    # Sharded over the target's ranks, the draft's heads must split over them too: Qwen2's 2 do not
    # split over 4 (test_spec_tensor_parallel.py runs TP=2).
    with pytest.raises(ValueError, match=r"tensor_parallel_size .* speculative_config.model's heads"):
        spec = draft_config(drafts["qwen2-1-layer"])
        make_llm(model_config, tensor_parallel_size=4, speculative_config=spec)
    with pytest.raises(ValueError, match=r"speculative_config\.model: model '/nonexistent/draft'"):
        make_llm(model_config, speculative_config=draft_config("/nonexistent/draft"))


@pytest.mark.slow
def test_a_block_costs_both_models_bytes(target, drafts):
    """The draft's cache shares the target's block ids: the same kv_cache_memory holds fewer
    blocks, by exactly the draft's share (after its proposals' scratch blocks)."""
    _, model_config = target
    budget = 1 << 20
    plain = make_llm(model_config, block_size=4, kv_cache_memory=budget)
    llm = make_llm(
        model_config,
        block_size=4,
        kv_cache_memory=budget,
        speculative_config=draft_config(drafts["qwen2-1-layer"]),
    )
    worker = llm.llm_engine.executor.worker
    drafter = worker.model_runner.drafter
    target_bytes = worker.kv_cache_spec.block_bytes
    num_blocks = llm.llm_engine.scheduler.kv_cache_manager.num_total_gpu_blocks
    assert num_blocks == (budget - drafter.scratch_bytes) // (target_bytes + drafter.block_bytes)
    assert plain.llm_engine.scheduler.kv_cache_manager.num_total_gpu_blocks == budget // target_bytes


@pytest.mark.slow
def test_swapped_groups_bring_the_drafts_cache_back_with_the_targets(target, drafts):
    """n = 2 requests are groups, which preemption swaps out: the swap moves the draft's blocks
    too, so the target as its own draft is still always accepted. (top_k=1: both samples are the
    greedy tokens, which n > 1 refuses at temperature 0.)"""
    _, model_config = target
    prompts = mixed_prompts(6, model_config.vocab_size, seed=7)
    params = SamplingParams(n=2, temperature=1.0, top_k=1, max_tokens=24, ignore_eos=True)
    plain = make_llm(model_config, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [
        [t, t]
        for t in token_ids(plain.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False))
    ]
    tight = make_llm(
        model_config,
        block_size=4,
        num_kv_blocks=40,
        max_model_len=96,
        swap_space=0.01,
        speculative_config=draft_config(drafts["self"]),
    )
    outputs = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == expected
    assert tight.llm_engine.get_stats().num_preemptions_swap > 0
    counters = spec(tight)
    assert counters.num_accepted_tokens == counters.num_draft_tokens > 0
    assert_all_blocks_free(tight)
