"""Pipeline parallelism over CPU ranks (gloo), run by the "mp" executor: two stages, and two
stages of two tensor-parallel ranks each, give the greedy tokens of one rank; each stage holds its
own layers only; what stages cannot run is refused before anything loads."""

from __future__ import annotations

import itertools

import pytest
from transformers import BloomConfig, Gemma2Config, LlamaConfig, MistralConfig, Qwen3Config

from pagedllm import LLM, SamplingParams
from pagedllm.distributed import pipeline_stage_layers
from pagedllm.entrypoints.bench.weight_read import worker_decode_weight_bytes
from pagedllm.executor.abstract import ExecutorDeadError

# Layouts that stages split differently: a tied LM head (the last stage keeps the embedding
# for it), an untied one, three layers over two stages (2 + 1), Gemma's scaled embedding and
# sandwich norms, Qwen3's per-head norms, and a vocabulary that does not split evenly over ranks.
CASES = {
    "llama-gqa-tied": (
        LlamaConfig,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
    ),
    "llama-kv1-bias-untied-3-layers": (
        LlamaConfig,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "attention_bias": True,
            "num_hidden_layers": 3,
            "tie_word_embeddings": False,
        },
    ),
    "mistral-odd-vocab": (
        MistralConfig,
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "sliding_window": None,
            "vocab_size": 161,
        },
    ),
    "qwen3-qknorm": (
        Qwen3Config,
        {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "tie_word_embeddings": False},
    ),
    "gemma2-softcap": (
        Gemma2Config,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 8},
    ),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# Stages compute what one rank does in the same order: a seeded sample is the same draw too, and
# a best_of request forks after its first samples as at one rank.
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)
BEST_OF = SamplingParams(n=2, best_of=3, temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_stages_split_the_layers_in_order_and_cover_them_once():
    for num_layers in range(1, 9):
        for num_stages in range(1, num_layers + 1):
            stages = [pipeline_stage_layers(num_layers, s, num_stages) for s in range(num_stages)]
            assert [i for stage in stages for i in stage] == list(range(num_layers))
            assert max(map(len, stages)) - min(map(len, stages)) <= 1 and min(map(len, stages)) >= 1


@pytest.mark.parametrize("case", CASES)
def test_two_stages_give_the_tokens_of_one_rank(
    case, make_tiny_model_once, random_prompts, assert_every_block_free
):
    config_class, overrides = CASES[case]
    _, model_config = make_tiny_model_once(config_class, **overrides)
    prompts = random_prompts(6, model_config.vocab_size)
    params = [GREEDY] * 4 + [SEEDED, BEST_OF]
    one = LLM(model_config.model, device="cpu", swap_space=0.01)
    expected = one.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)

    # Asynchronous scheduling, as on GPUs: a step is sent before the previous one's answer is read.
    two = LLM(
        model_config.model, device="cpu", swap_space=0.01, pipeline_parallel_size=2, async_scheduling=True
    )
    try:
        assert two.llm_engine.config.parallel_config.distributed_executor_backend == "mp"
        outputs = two.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert token_ids(outputs) == token_ids(expected)
        assert_every_block_free(two.llm_engine)
        # Each stage holds its layers only: less than the whole model, together all of it (the
        # embedding twice when the last stage keeps it for a tied LM head).
        whole = worker_decode_weight_bytes(one.llm_engine.executor.worker)
        stages = two.llm_engine.executor.collective_rpc(worker_decode_weight_bytes)
        assert len(stages) == 2 and max(stages) < whole <= sum(stages)
        num_layers = model_config.num_layers
        kv_layers = [spec.num_layers for spec in two.llm_engine.executor.collective_rpc("get_kv_cache_spec")]
        assert kv_layers == [len(pipeline_stage_layers(num_layers, s, 2)) for s in range(2)]
    finally:
        two.llm_engine.shutdown()


def test_steps_in_flight_together_are_different_micro_batches(make_tiny_model_once, random_prompts):
    """With asynchronous scheduling a step goes out before the previous one is applied, and holds
    none of its requests (their samples are in flight), each decoding at most half of
    max_num_seqs: the two stages work on two micro-batches at once, and the tokens stay those of
    one rank."""
    _, model_config = make_tiny_model_once(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    prompts = random_prompts(8, model_config.vocab_size, lo=3, hi=6)
    options = dict(device="cpu", swap_space=0.01, max_num_seqs=8)
    expected = LLM(model_config.model, **options).generate(
        prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False
    )
    two = LLM(model_config.model, pipeline_parallel_size=2, async_scheduling=True, **options)
    executor = two.llm_engine.executor
    steps: list[tuple[set[int], int]] = []
    execute = executor.execute_model

    def record(msg):
        handle = execute(msg)
        if msg.total_num_scheduled_tokens:
            steps.append((set(msg.num_scheduled_tokens), len(executor._pending)))
        return handle

    executor.execute_model = record
    try:
        outputs = two.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert token_ids(outputs) == token_ids(expected)
    finally:
        two.llm_engine.shutdown()
    # Pairs whose second step went out while the first was in flight (unanswered).
    overlapped = [(a, b) for (a, _), (b, pending) in itertools.pairwise(steps) if pending == 2]
    assert len(overlapped) >= 10 and all(not a & b for a, b in overlapped)
    assert max(len(ids) for ids, _ in steps[1:]) <= 4  # decodes: half of max_num_seqs a step


def test_two_stages_of_two_ranks_with_sampling_logprobs_and_preemption(
    make_tiny_model_once, random_prompts, assert_every_block_free
):
    """TP=2 x PP=2 (four ranks): greedy tokens and their logprobs as one rank computes them, prompt
    logprobs, preemption by recompute and by swap (beams), prefix caching."""
    _, model_config = make_tiny_model_once(
        LlamaConfig, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3
    )
    shared_prefix = random_prompts(1, model_config.vocab_size, lo=12, hi=12, seed=7)[0]
    prompts = [
        shared_prefix + tail for tail in random_prompts(8, model_config.vocab_size, lo=1, hi=12, seed=1)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    beams = SamplingParams(
        n=2, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=24, ignore_eos=True
    )
    params = [beams if i % 4 == 3 else greedy for i in range(len(prompts))]
    options = dict(device="cpu", block_size=4, swap_space=0.01, max_model_len=64, enable_prefix_caching=True)

    roomy = LLM(model_config.model, **options)
    expected = roomy.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    # 24 blocks of 4 tokens: far fewer than the 8 requests need at once, so some are preempted.
    # Micro-batches in flight (asynchronous scheduling) through the preemptions.
    tight = LLM(
        model_config.model,
        num_kv_blocks=24,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        async_scheduling=True,
        **options,
    )
    try:
        outputs = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        stats = tight.llm_engine.get_stats()
        assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap > 0
        assert stats.prefix_cache_hit_rate > 0
        assert token_ids(outputs) == token_ids(expected)
        for got, want in zip(outputs, expected):
            for a, b in zip(got.outputs, want.outputs):
                if a.logprobs:
                    assert [sorted(p) for p in a.logprobs] == [sorted(p) for p in b.logprobs]
                    for pa, pb in zip(a.logprobs, b.logprobs):
                        for token in pa:
                            assert pa[token].logprob == pytest.approx(pb[token].logprob, abs=1e-4)
            if got.prompt_logprobs:
                assert len(got.prompt_logprobs) == len(want.prompt_logprobs)
        assert_every_block_free(tight.llm_engine)
    finally:
        tight.llm_engine.shutdown()


def test_a_killed_stage_fails_the_requests_within_seconds(make_tiny_model_once, kill_a_rank_mid_batch):
    _, model_config = make_tiny_model_once(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    llm = LLM(model_config.model, device="cpu", swap_space=0.01, pipeline_parallel_size=2)
    kill_a_rank_mid_batch(llm.llm_engine)
    for process in llm.llm_engine.executor.ranks.processes:
        process.join(10)
        assert not process.is_alive()
    with pytest.raises(ExecutorDeadError, match="rank 1"):
        llm.llm_engine.check_health()


def test_what_stages_cannot_run_is_refused_before_loading(make_tiny_model_once):
    _, llama = make_tiny_model_once(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size must give every stage.*at most 2, got 3"):
        LLM(llama.model, device="cpu", pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an int >= 1"):
        LLM(llama.model, device="cpu", pipeline_parallel_size=0)
    with pytest.raises(
        ValueError, match="pipeline_parallel_size must be 1 with distributed_executor_backend='uni'"
    ):
        LLM(llama.model, device="cpu", pipeline_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="speculative_config must be None with pipeline_parallel_size=2"):
        LLM(
            llama.model,
            device="cpu",
            pipeline_parallel_size=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    _, bloom = make_tiny_model_once(BloomConfig, n_head=4)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not supported for BloomForCausalLM"):
        LLM(bloom.model, device="cpu", pipeline_parallel_size=2)
