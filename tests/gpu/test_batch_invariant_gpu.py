"""batch_invariant=True on the GPU, Qwen3-0.6B's and Llama-3.1-8B's configs with dummy bf16 weights
(the 8B's layers run the GEMM's long-K tiles), and Qwen3-30B-A3B's mixture of experts in 6 of its
layers: 16 greedy requests give the same tokens and the same logprobs (every bit) alone, with 15
others and with 63 others; for the dense models the same with prefix caching and chunked prefill
on (other chunk boundaries, cached prefixes, and the GEMM's narrow output tiles where a whole
prefill takes the wide ones); the same at TP=2; and the logprobs reported while generating equal
those of a scoring pass over prompt + output, for 256 requests. Without the mode, 2 of 16 such
requests diverged (H200, 2026-11-27)."""

from __future__ import annotations

import gc
import json
import os
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs")
MODEL = os.path.join(CONFIGS, "qwen3-0.6b")
NUM_TARGETS = 16
Result = tuple[list[int], list[float]]
# Plain, and with prefix caching and chunked prefill: chunks of at most 96 tokens cut prompts at
# other places than the plain engine's whole-prompt prefill does (64 sequences at most, which a
# 96-token step can all decode).
CACHED_CHUNKED = {
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 96,
    "max_num_seqs": 64,
}
LLAMA = os.path.join(CONFIGS, "llama-3.1-8b")
# Qwen3-30B-A3B's mixture of experts (128 experts, top 8) in 6 layers of its 48: whose experts a
# token meets, and so their pair counts, change with every batch.
MOE = "qwen3-30b-a3b, 6 layers"
ENGINES = {
    "plain": (MODEL, {"max_num_seqs": 256}),
    "prefix-caching-chunked": (MODEL, CACHED_CHUNKED),
    "llama-3.1-8b": (LLAMA, {"max_num_seqs": 64}),
    "llama-3.1-8b-prefix-caching-chunked": (LLAMA, CACHED_CHUNKED),
    "qwen3-30b-a3b-moe": (MOE, {"max_num_seqs": 256}),
}
# Engines whose results alone must equal each other's (the same model, other chunkings).
SAME_MODEL = [("plain", "prefix-caching-chunked"), ("llama-3.1-8b", "llama-3.1-8b-prefix-caching-chunked")]


def _requests(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 20-200 tokens, half behind one shared 48-token prefix (prefix-cache hits), and
    greedy params asking 24-40 tokens (a batch shrinks as requests finish: padded CUDA graphs)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 128_000) for _ in range(48)]
    prompts, params = [], []
    for i in range(n):
        tail = [rng.randrange(3, 128_000) for _ in range(rng.randint(20, 150))]
        prompts.append(shared + tail if i % 2 else tail)
        params.append(
            SamplingParams(temperature=0.0, max_tokens=rng.randint(24, 40), logprobs=0, ignore_eos=True)
        )
    return prompts, params


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[Result]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]
        results.append((list(completion.token_ids), logprobs))
    return results


def _moe_config(directory) -> str:
    with open(os.path.join(CONFIGS, "qwen3-30b-a3b", "config.json")) as file:
        config = json.load(file)
    config["num_hidden_layers"] = 6
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump(config, file)
    return str(directory)


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(request, tmp_path_factory):
    model, options = ENGINES[request.param]
    if model == MOE:
        model = _moe_config(tmp_path_factory.mktemp("moe"))
    llm = LLM(
        model,
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=1024,
        gpu_memory_utilization=0.5,
        batch_invariant=True,
        **options,
    )
    yield request.param, llm
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


# Each engine's results alone, kept to compare the engines with each other.
_ALONE: dict[str, list[Result]] = {}


def test_sixteen_requests_identical_alone_with_15_and_with_63_others(engine):
    name, llm = engine
    prompts, params = _requests(64, seed=0)
    targets = slice(0, NUM_TARGETS)
    alone = [_generate(llm, [p], [sp])[0] for p, sp in zip(prompts[targets], params[targets])]
    with_15 = _generate(llm, prompts[targets], params[targets])
    with_63 = _generate(llm, prompts, params)[targets]
    diverged = [i for i in range(NUM_TARGETS) if not alone[i] == with_15[i] == with_63[i]]
    assert not diverged, f"requests {diverged} of {NUM_TARGETS} depend on their batch ({name})"
    _ALONE[name] = alone
    # Chunk boundaries and cached prefixes change nothing either; nor do the GEMM's output tiles:
    # a whole batch's prefill runs the wide tiles, 96-token chunks the narrow.
    for first, second in SAME_MODEL:
        if first in _ALONE and second in _ALONE:
            assert _ALONE[first] == _ALONE[second], (first, second)


def test_generated_logprobs_equal_the_scoring_pass_for_256_requests(engine):
    _, llm = engine
    prompts, params = _requests(256, seed=1)
    generated = _generate(llm, prompts, params)
    full = [prompt + tokens for prompt, (tokens, _) in zip(prompts, generated)]
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(prompt_token_ids=full, sampling_params=score, use_tqdm=False)
    mismatched = []
    for i, (prompt, (tokens, logprobs), output) in enumerate(zip(prompts, generated, outputs)):
        scored = [entry[t].logprob for t, entry in zip(tokens, output.prompt_logprobs[len(prompt) :])]
        if scored != logprobs:
            mismatched.append(i)
    assert not mismatched, f"{len(mismatched)} of 256 requests scored other logprobs than generated"


def test_refuses_a_backend_without_an_invariant_path():
    with pytest.raises(ValueError, match="batch_invariant=True: attention_backend='cuda'"):
        LLM(
            MODEL,
            device="cuda",
            load_format="dummy",
            skip_tokenizer_init=True,
            attention_backend="cuda",
            batch_invariant=True,
        )


@pytest.mark.two_gpus
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_2_is_identical_to_itself_across_batch_sizes():
    llm = LLM(
        MODEL,
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=1024,
        tensor_parallel_size=2,  # the default memory share: the module's engine may still hold half
        batch_invariant=True,
    )
    prompts, params = _requests(64, seed=2)
    targets = slice(0, NUM_TARGETS)
    try:
        alone = [_generate(llm, [p], [sp])[0] for p, sp in zip(prompts[targets], params[targets])]
        with_15 = _generate(llm, prompts[targets], params[targets])
        with_63 = _generate(llm, prompts, params)[targets]
    finally:
        llm.llm_engine.shutdown()  # the rank processes
    diverged = [i for i in range(NUM_TARGETS) if not alone[i] == with_15[i] == with_63[i]]
    assert not diverged, f"requests {diverged} of {NUM_TARGETS} depend on their batch at TP=2"
