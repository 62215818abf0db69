"""Tensor parallelism over two CPU ranks (gloo), run by the "mp" executor: the same greedy tokens
as one rank, under preemption and prefix caching too; a dead rank fails the engine fast."""

from __future__ import annotations

import re

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from pagedllm import LLM, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.bench.weight_read import worker_decode_weight_bytes
from pagedllm.executor.abstract import ExecutorDeadError
from pagedllm.sampling_params import StructuredOutputsParams
from tests.executor.reductions import all_deferred, deferred_reductions

# Every architecture of the registry, with the layouts that shard differently: GQA split over the
# ranks, one KV head replicated on both, biases (row-parallel o/down add theirs once), tied and
# untied LM heads, Qwen3's per-head norms, and a vocabulary that does not split evenly.
CASES = {
    "llama-gqa-tied": (
        LlamaConfig,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
    ),
    "llama-kv1-bias-untied": (
        LlamaConfig,
        {"num_attention_heads": 4, "num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True},
    ),
    "mistral-gqa4-odd-vocab": (
        MistralConfig,
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "sliding_window": None,
            "vocab_size": 161,
        },
    ),
    "qwen2-bias-tied": (
        Qwen2Config,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
    ),
    "qwen3-qknorm-kv1": (
        Qwen3Config,
        {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "tie_word_embeddings": False},
    ),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_ranks_stopped(engine: LLMEngine) -> None:
    for process in engine.executor.ranks.processes:
        process.join(10)
        assert not process.is_alive()


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_give_the_tokens_of_one(
    case, make_tiny_model_once, random_prompts, assert_every_block_free
):
    config_class, overrides = CASES[case]
    _, model_config = make_tiny_model_once(config_class, **overrides)
    prompts = random_prompts(6, model_config.vocab_size)
    one = LLM(model_config.model, device="cpu", swap_space=0.01)
    expected = one.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)

    # Asynchronous scheduling, as on GPUs: a step is sent before the previous one's answer is read.
    two = LLM(
        model_config.model, device="cpu", swap_space=0.01, tensor_parallel_size=2, async_scheduling=True
    )
    try:
        assert two.llm_engine.config.parallel_config.distributed_executor_backend == "mp"
        outputs = two.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert token_ids(outputs) == token_ids(expected)
        assert_every_block_free(two.llm_engine)
        # Each layer's two all-reduces ran in the norms after them (on the CPU: gloo's
        # all-reduce, then the norm), on both ranks.
        num_layers = model_config.hf_config.num_hidden_layers
        assert two.llm_engine.executor.collective_rpc(deferred_reductions) == [all_deferred(num_layers)] * 2
        # A request aborted in flight: the last step only tells the ranks it finished, and its
        # answer, never waited for, must not be taken for the next call's.
        engine = two.llm_engine
        engine.add_request("aborted", sampling_params=GREEDY, prompt_token_ids=prompts[0])
        engine.step()
        engine.abort_request("aborted")
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.executor.ranks.conns[0].poll(10), "rank 0's answer to that step is unread"
        # Each rank holds a shard: less than the whole model, together at least all of it.
        whole = worker_decode_weight_bytes(one.llm_engine.executor.worker)
        shards = two.llm_engine.executor.collective_rpc(worker_decode_weight_bytes)
        assert len(shards) == 2 and max(shards) < whole <= sum(shards)
    finally:
        two.llm_engine.shutdown()
    assert_ranks_stopped(two.llm_engine)


def test_four_ranks_give_the_tokens_of_one(make_tiny_model_once, random_prompts, assert_every_block_free):
    """TP=4: two KV heads for four ranks (each replicated on two), an MLP and a vocabulary split
    four ways (the vocabulary unevenly)."""
    _, model_config = make_tiny_model_once(
        LlamaConfig, num_attention_heads=4, num_key_value_heads=2, vocab_size=163, tie_word_embeddings=False
    )
    prompts = random_prompts(4, model_config.vocab_size)
    expected = LLM(model_config.model, device="cpu", swap_space=0.01).generate(
        prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False
    )
    four = LLM(model_config.model, device="cpu", swap_space=0.01, tensor_parallel_size=4)
    try:
        outputs = four.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert token_ids(outputs) == token_ids(expected)
        assert_every_block_free(four.llm_engine)
    finally:
        four.llm_engine.shutdown()


def test_preemption_and_prefix_caching_at_two_ranks_change_no_output(
    make_tiny_model_once, random_prompts, assert_every_block_free
):
    _, model_config = make_tiny_model_once(LlamaConfig, num_attention_heads=4, num_key_value_heads=1)
    shared_prefix = random_prompts(1, model_config.vocab_size, lo=12, hi=12, seed=7)[0]
    prompts = [
        shared_prefix + tail for tail in random_prompts(8, model_config.vocab_size, lo=1, hi=12, seed=1)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    beams = SamplingParams(
        n=2, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=24, ignore_eos=True
    )
    params = [beams if i % 4 == 3 else greedy for i in range(len(prompts))]

    roomy = LLM(model_config.model, device="cpu", block_size=4, swap_space=0.01)
    expected = roomy.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    # 24 blocks of 4 tokens: far fewer than the 8 requests need at once, so some are preempted,
    # by recompute (one sequence) and by swapping (the beams).
    tight = LLM(
        model_config.model,
        device="cpu",
        block_size=4,
        num_kv_blocks=24,
        max_model_len=64,
        swap_space=0.01,
        enable_prefix_caching=True,
        tensor_parallel_size=2,
    )
    try:
        outputs = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        stats = tight.llm_engine.get_stats()
        assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap > 0
        assert stats.prefix_cache_hit_rate > 0
        assert token_ids(outputs) == token_ids(expected)
        assert_every_block_free(tight.llm_engine)
    finally:
        tight.llm_engine.shutdown()


def test_a_killed_rank_fails_the_requests_within_seconds_and_stops_every_rank(
    make_tiny_model_once, kill_a_rank_mid_batch
):
    _, model_config = make_tiny_model_once(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    llm = LLM(model_config.model, device="cpu", swap_space=0.01, tensor_parallel_size=2)
    kill_a_rank_mid_batch(llm.llm_engine)
    assert_ranks_stopped(llm.llm_engine)
    with pytest.raises(ExecutorDeadError, match="rank 1"):
        llm.llm_engine.check_health()
    with pytest.raises(ExecutorDeadError):
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY, use_tqdm=False)


@pytest.mark.parametrize(
    "large",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["decode-messages", "messages-over-a-socket-buffer"],
)
def test_step_messages_go_out_before_the_previous_answer_is_read(large, make_tiny_model_once, random_prompts):
    """A step's message is sent while the step before it is unanswered (rank 0's answers are then
    read in order), a small decode step's and a batch of prompts larger than a local socket's
    buffer alike: the ranks read their messages while their reply threads send answers, so a
    write that blocks waits only for the rank to finish the step it runs (a pipeline's first
    stage gets step N + 1 while the last runs step N)."""
    from pagedllm.executor.worker_loop import encode_call

    _, model_config = make_tiny_model_once(
        LlamaConfig, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024
    )
    if large:
        prompts = random_prompts(128, model_config.vocab_size, lo=1000, hi=1000)
        options = dict(max_num_seqs=128, max_num_batched_tokens=128_000, max_model_len=1024)
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    else:
        prompts, options, params = random_prompts(4, model_config.vocab_size), {}, GREEDY
    expected = LLM(model_config.model, device="cpu", swap_space=0.01, **options).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False
    )
    two = LLM(
        model_config.model,
        device="cpu",
        swap_space=0.01,
        tensor_parallel_size=2,
        async_scheduling=True,
        **options,
    )
    executor = two.llm_engine.executor
    unanswered: list[int] = []
    sizes: list[int] = []
    execute = executor.execute_model

    def record(msg):
        step = execute(msg)
        unanswered.append(len(executor._pending))
        sizes.append(len(encode_call("execute_model_remote", (msg,), None, 0)))
        return step

    executor.execute_model = record
    try:
        outputs = two.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert token_ids(outputs) == token_ids(expected)
        assert max(unanswered) == 2
        if large:  # Linux's default socket buffer is 208 KiB
            assert max(sizes) > 256 * 1024
    finally:
        two.llm_engine.shutdown()


@pytest.mark.slow
def test_a_sliding_window_with_sinks_at_two_ranks_gives_the_tokens_of_one(
    make_tiny_model_once, random_prompts, assert_every_block_free
):
    """Behind a window the ranks read cache positions (the dropped tokens reach them in the step
    message); with sinks, generation runs past max_model_len on both."""
    _, model_config = make_tiny_model_once(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    prompts = random_prompts(4, model_config.vocab_size, lo=5, hi=40, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    options = dict(device="cpu", block_size=4, max_model_len=64, sliding_window=16, attention_sinks=4)
    expected = LLM(model_config.model, swap_space=0.01, **options).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False
    )
    two = LLM(model_config.model, swap_space=0.01, tensor_parallel_size=2, async_scheduling=True, **options)
    try:
        outputs = two.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert token_ids(outputs) == token_ids(expected)
        assert all(len(o.outputs[0].token_ids) == 100 for o in outputs)
        assert_every_block_free(two.llm_engine)
    finally:
        two.llm_engine.shutdown()


def grammar_role(worker) -> tuple[str, bool]:
    """A rank's part in structured outputs, and whether it built a grammar compiler's manager."""
    grammars = worker.model_runner.logits_processors.grammars
    compiler = getattr(getattr(grammars, "grammars", grammars), "_compile_grammar", None)
    return type(grammars).__name__, getattr(compiler, "_manager", None) is not None


@pytest.mark.parametrize(
    "sizes, roles",
    [
        ({"tensor_parallel_size": 2}, [("SourceGrammarMask", True), ("ReceivedGrammarMask", False)]),
        # Two pipeline stages, micro-batches in flight: the last stage samples, so it keeps the
        # grammars (no broadcast: it is one rank); the first holds none.
        (
            {"pipeline_parallel_size": 2, "async_scheduling": True},
            [("ReceivedGrammarMask", False), ("GrammarConstraint", True)],
        ),
    ],
    ids=["tp2", "pp2"],
)
def test_output_constraints_hold_at_two_ranks(tiny_llama_with_tokenizer, sizes, roles):
    """A compiled grammar is a native object that does not cross processes: the sampling rank
    compiles the constraint it receives and, with tensor parallelism, broadcasts each step's
    bitmask; the other rank compiles nothing. The sampled tokens stay inside the grammar, as at one
    rank (a rank sampling under another mask would feed itself other tokens, and the two ranks'
    shards would no longer add up)."""
    regex = StructuredOutputsParams(regex="(ab|c){1,3}x")
    choice = StructuredOutputsParams(choice=["alpha beta", "gamma"])
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=constraint)
        for constraint in (regex, choice, None)
    ]
    prompts = [[10, 11, 12], [40, 41], [7, 8, 9]]
    one = LLM(tiny_llama_with_tokenizer, device="cpu", swap_space=0.01)
    expected = one.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    two = LLM(tiny_llama_with_tokenizer, device="cpu", swap_space=0.01, **sizes)
    try:
        outputs = two.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert two.llm_engine.executor.collective_rpc(grammar_role) == roles
    finally:
        two.llm_engine.shutdown()
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in expected]
    assert re.fullmatch("(ab|c){1,3}x", outputs[0].outputs[0].text)
    assert outputs[1].outputs[0].text in ("alpha beta", "gamma")


def test_the_symmetric_buffer_holds_the_fused_kernel_s_flags():
    """symm_mem (below the kernels) sizes the flag tail all_reduce_norm.py's kernel uses."""
    from pagedllm.distributed.symm_mem import FLAG_BYTES as BUFFER_FLAG_BYTES
    from pagedllm.kernels.triton.all_reduce_norm import FLAG_BYTES

    assert BUFFER_FLAG_BYTES == FLAG_BYTES
