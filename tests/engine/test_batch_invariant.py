"""batch_invariant=True on the CPU: a request's greedy tokens and their logprobs are the same bits
alone, in batches of several sizes, behind a cached prefix and split into chunks at several
boundaries; and the logprobs reported while generating equal the prompt logprobs of a scoring pass
over prompt + output. The oracle is the request run alone, with nothing else in the engine: a
different batch must not change a single bit."""

from __future__ import annotations

import os
import random

import pytest

from pagedllm import LLM, SamplingParams

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)


def _prompts(n: int, vocab_size: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


Result = tuple[list[int], list[float]]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[Result]:
    """Each prompt's tokens and the logprob of each (the sampled token's own, as floats: compared
    with ==, so every bit counts)."""
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]
        results.append((list(completion.token_ids), logprobs))
    return results


def _alone(llm: LLM, prompts: list[list[int]]) -> list[Result]:
    return [_generate(llm, [prompt])[0] for prompt in prompts]


def _llm(model: str, **kwargs) -> LLM:
    return LLM(model, device="cpu", skip_tokenizer_init=True, batch_invariant=True, block_size=4, **kwargs)


@pytest.fixture(scope="module", params=["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def engine(request, tiny_llama_dir: str) -> tuple[LLM, list[list[int]], list[Result]]:
    llm = _llm(tiny_llama_dir, dtype=request.param, max_num_seqs=16)
    prompts = _prompts(9, 160, seed=1)
    return llm, prompts, _alone(llm, prompts)


@pytest.mark.parametrize("batch_size", [2, 3, 9])
def test_tokens_and_logprobs_equal_alone_and_in_batches(engine, batch_size: int):
    llm, prompts, alone = engine
    batched = []
    for start in range(0, len(prompts), batch_size):
        batched += _generate(llm, prompts[start : start + batch_size])
    assert batched == alone


@pytest.mark.slow
def test_equal_behind_a_cached_prefix(tiny_llama_dir: str):
    llm = _llm(tiny_llama_dir, enable_prefix_caching=True)
    prefix = _prompts(1, 160, seed=2, lo=21, hi=21)[0]  # 5 full blocks and a partial one
    prompts = [prefix + tail for tail in _prompts(4, 160, seed=3, lo=1, hi=9)]
    cold = _alone(llm, prompts)  # the first fills the cache, the others hit it
    assert llm.llm_engine.scheduler.kv_cache_manager.num_cache_hit_tokens >= 3 * 20
    fresh = _llm(tiny_llama_dir, enable_prefix_caching=False)
    assert cold == _alone(fresh, prompts)
    assert _generate(llm, prompts) == cold  # every prompt behind the cached prefix, batched


@pytest.fixture(scope="module")
def long_prompts_alone(tiny_llama_dir: str) -> tuple[list[list[int]], list[Result]]:
    prompts = _prompts(4, 160, seed=4, lo=20, hi=60)
    return prompts, _alone(_llm(tiny_llama_dir), prompts)


@pytest.mark.slow
@pytest.mark.parametrize("max_num_batched_tokens", [5, 13, 32])
def test_equal_with_chunked_prefill_at_several_boundaries(
    tiny_llama_dir: str, long_prompts_alone, max_num_batched_tokens: int
):
    prompts, alone = long_prompts_alone
    chunked = _llm(
        tiny_llama_dir,
        enable_chunked_prefill=True,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=4,
    )
    assert _generate(chunked, prompts) == alone


def test_generated_logprobs_equal_the_scoring_pass(engine):
    """What an RL trainer checks: the sampler's logprobs against its own scoring of the sequence."""
    llm, prompts, alone = engine
    full = [prompt + tokens for prompt, (tokens, _) in zip(prompts, alone)]
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(prompt_token_ids=full, sampling_params=score, use_tqdm=False)
    for prompt, (tokens, logprobs), output in zip(prompts, alone, outputs):
        scored = [entry[token].logprob for token, entry in zip(tokens, output.prompt_logprobs[len(prompt) :])]
        assert scored == logprobs


@pytest.mark.parametrize(
    ("kwargs", "piece"),
    [
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative_config"),
        ({"enable_lora": True}, "enable_lora"),
        ({"cpu_compile": True}, "cpu_compile"),
        ({"tensor_parallel_size": 4}, "tensor_parallel_size > 2"),
        ({"context_parallel_size": 2}, "context_parallel_size > 1"),
    ],
)
def test_refuses_pieces_without_an_invariant_path(tiny_llama_dir: str, kwargs: dict, piece: str):
    with pytest.raises(ValueError, match=f"batch_invariant=True: {piece}"):
        _llm(tiny_llama_dir, **kwargs)


def test_refuses_a_mixture_of_experts_before_loading():
    config = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs", "qwen3-30b-a3b")
    with pytest.raises(ValueError, match="batch_invariant=True: mixture-of-experts"):
        LLM(config, device="cpu", load_format="dummy", skip_tokenizer_init=True, batch_invariant=True)


def test_refuses_quantized_weights(smollm2_gguf: str):
    with pytest.raises(ValueError, match="batch_invariant=True: a GGUF model kept quantized"):
        LLM(smollm2_gguf, device="cpu", quantization="gguf", batch_invariant=True)


def test_refuses_a_linear_attention_hybrid_before_loading():
    config = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs", "qwen3-next-2b")
    with pytest.raises(ValueError, match="batch_invariant=True: models with linear-attention layers"):
        LLM(config, device="cpu", load_format="dummy", skip_tokenizer_init=True, batch_invariant=True)
