"""Context parallelism over CPU ranks (gloo), run by the "mp" executor: two and three ranks
striping every sequence's KV cache, alone and with two tensor-parallel ranks each, give Hugging
Face's greedy tokens in float32, through chunked prefill, preemption and prefix caching; each
rank holds its stripe only; a killed rank fails the engine fast; what the stripes cannot hold is
refused before anything loads."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen3Config

from pagedllm import LLM, SamplingParams
from pagedllm.executor.abstract import ExecutorDeadError

# Layouts the stripes meet differently: GQA with fewer KV heads than tensor-parallel ranks
# (replicated), Qwen3's per-head norms, a sliding window narrower than the prompts (keys are
# visible by their striped position), Gemma-2's soft cap and alternating windows.
CASES = {
    "llama-gqa": (LlamaConfig, {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "qwen3-kv1": (
        Qwen3Config,
        {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "tie_word_embeddings": False},
    ),
    "mistral-window": (
        MistralConfig,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "sliding_window": 7},
    ),
    "gemma2-softcap": (
        Gemma2Config,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 8},
    ),
}
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Every rank merges the same partials in the same order: a seeded sample is the same draw too.
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("case", CASES)
def test_two_context_ranks_give_hf_greedy_tokens(
    case, make_tiny_model_once, random_prompts, assert_every_block_free, hf_greedy_tokens
):
    config_class, overrides = CASES[case]
    hf_model, model_config = make_tiny_model_once(config_class, **overrides)
    prompts = random_prompts(5, model_config.vocab_size, lo=1, hi=40)
    expected = [hf_greedy_tokens(hf_model, prompt, MAX_TOKENS) for prompt in prompts]
    # Chunks of 16 tokens: a prompt's later chunks attend to keys the other rank cached earlier.
    llm = LLM(
        model_config.model,
        device="cpu",
        swap_space=0.01,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        enable_chunked_prefill=True,
        context_parallel_size=2,
        async_scheduling=True,
    )
    try:
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert token_ids(outputs) == expected
        assert_every_block_free(llm.llm_engine)
        # The engine counts blocks of block_size x 2 tokens: each rank's block holds half of one.
        assert llm.llm_engine.config.scheduler_block_size == 8
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
def test_context_ranks_with_tensor_parallel_ranks_and_preemption(
    make_tiny_model_once, random_prompts, assert_every_block_free
):
    """CP=2 x TP=2 on four ranks (one KV head, replicated), and CP=3 on three: the tokens of
    one rank, with prefix caching on and a cache small enough that requests are preempted, by
    recompute and by swap (beams), and a seeded sample among them."""
    _, model_config = make_tiny_model_once(LlamaConfig, num_attention_heads=4, num_key_value_heads=1)
    shared_prefix = random_prompts(1, model_config.vocab_size, lo=20, hi=20, seed=7)[0]
    prompts = [
        shared_prefix + tail for tail in random_prompts(8, model_config.vocab_size, lo=1, hi=12, seed=1)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    beams = SamplingParams(
        n=2, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=24, ignore_eos=True
    )
    params = [beams if i % 4 == 3 else SEEDED if i == 5 else greedy for i in range(len(prompts))]
    roomy = LLM(model_config.model, device="cpu", block_size=4, swap_space=0.01)
    expected = [
        [c.token_ids for c in o.outputs]
        for o in roomy.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    ]
    for sizes in ({"context_parallel_size": 2, "tensor_parallel_size": 2}, {"context_parallel_size": 3}):
        cp = sizes["context_parallel_size"]
        # 8 blocks of 4 x cp tokens: fewer than the 8 requests need at once.
        tight = LLM(
            model_config.model,
            device="cpu",
            block_size=4,
            num_kv_blocks=24 // cp,
            max_model_len=64,
            swap_space=0.01,
            enable_prefix_caching=True,
            **sizes,
        )
        try:
            outputs = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            stats = tight.llm_engine.get_stats()
            assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap > 0, sizes
            assert stats.prefix_cache_hit_rate > 0, sizes
            assert [[c.token_ids for c in o.outputs] for o in outputs] == expected, sizes
            assert_every_block_free(tight.llm_engine)
        finally:
            tight.llm_engine.shutdown()


@pytest.mark.slow
def test_each_rank_caches_its_stripe_of_the_context(make_tiny_model_once):
    """A 30-token prompt at CP=2: each rank writes 15 slots, positions of its own parity, and the
    two ranks' caches together hold exactly the single rank's K (bit for bit in float32)."""
    _, model_config = make_tiny_model_once(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    prompt = list(range(1, 31))
    once = SamplingParams(temperature=0.0, max_tokens=1)

    one = LLM(model_config.model, device="cpu", attention_backend="torch", block_size=4, swap_space=0.01)
    one.generate(prompt_token_ids=[prompt], sampling_params=once, use_tqdm=False)
    whole = first_layer_keys(one.llm_engine.executor.worker)[:30]
    two = LLM(model_config.model, device="cpu", block_size=4, swap_space=0.01, context_parallel_size=2)
    try:
        two.generate(prompt_token_ids=[prompt], sampling_params=once, use_tqdm=False)
        halves = two.llm_engine.executor.collective_rpc(first_layer_keys)
    finally:
        two.llm_engine.shutdown()
    for rank, keys in enumerate(halves):
        assert torch.equal(keys[:15], whole[rank::2])


def first_layer_keys(worker) -> torch.Tensor:
    """The first layer's key cache, block after block (a fresh engine hands out blocks in order)."""
    key_cache = worker.cache_engine.gpu_cache[0][0]  # torch layout [blocks, block_size, heads, dim]
    return key_cache.flatten(0, 1).clone()


def test_a_killed_context_rank_fails_the_requests_within_seconds(make_tiny_model_once, kill_a_rank_mid_batch):
    _, model_config = make_tiny_model_once(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    llm = LLM(model_config.model, device="cpu", swap_space=0.01, context_parallel_size=2)
    kill_a_rank_mid_batch(llm.llm_engine)
    with pytest.raises(ExecutorDeadError):
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY, use_tqdm=False)


def test_what_the_stripes_cannot_hold_is_refused_before_loading(make_tiny_model_once):
    _, llama = make_tiny_model_once(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    refused = [
        ({"context_parallel_size": 0}, "context_parallel_size must be an int >= 1"),
        (
            {"context_parallel_size": 2, "distributed_executor_backend": "uni"},
            "context_parallel_size must be 1 with distributed_executor_backend='uni'",
        ),
        (
            {"context_parallel_size": 2, "pipeline_parallel_size": 2},
            "pipeline_parallel_size must be 1 with context_parallel_size=2",
        ),
        (
            {
                "context_parallel_size": 2,
                "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
            },
            "speculative_config=.* is not supported with context_parallel_size=2",
        ),
        (
            {"context_parallel_size": 2, "attention_backend": "cpu"},
            "attention_backend='cpu' is not supported with context_parallel_size=2",
        ),
    ]
    for kwargs, match in refused:
        with pytest.raises(ValueError, match=match):
            LLM(llama.model, device="cpu", **kwargs)
    from transformers import DeepseekV2Config

    _, mla = make_tiny_model_once(
        DeepseekV2Config,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
    )
    with pytest.raises(ValueError, match=r"latent attention \(MLA\) is not split by token"):
        LLM(mla.model, device="cpu", context_parallel_size=2)
