"""The whole engine on the Triton attention backend (on the CPU, under Triton's interpreter):
the same greedy tokens as the torch backend, through prefills, chunked prefills, decodes,
copy-on-write forks and preemption."""

import random

import pytest
import torch
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams

pytest.importorskip("triton")


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.slow
def test_triton_backend_matches_torch_end_to_end(make_tiny_model, block_size):
    _, model_config = make_tiny_model(
        LlamaConfig, num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=64
    )
    rng = random.Random(block_size)
    prompts = [[rng.randrange(3, 160) for _ in range(rng.randint(1, 40))] for _ in range(5)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True),
    ]
    per_prompt = [params[i % 2] for i in range(len(prompts))]
    common = dict(
        device="cpu",
        block_size=block_size,
        num_kv_blocks=96 // block_size,
        max_model_len=64,
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        swap_space=0.01,
    )
    reference = LLM(model_config.model, attention_backend="torch", **common)
    expected = reference.generate(prompt_token_ids=prompts, sampling_params=per_prompt, use_tqdm=False)
    triton_llm = LLM(model_config.model, attention_backend="triton", **common)
    got = triton_llm.generate(prompt_token_ids=prompts, sampling_params=per_prompt, use_tqdm=False)
    for g, e in zip(got, expected):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in e.outputs]
    stats = triton_llm.llm_engine.get_stats()
    assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
    bm = triton_llm.llm_engine.scheduler.kv_cache_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert torch.get_default_dtype() == torch.float32


def test_ngram_verifications_attend_in_query_groups_with_the_torch_backends_tokens(
    make_tiny_model, monkeypatch
):
    """The Triton backend's decodes take the step's query groups (paged_decode's query_lens):
    n-gram verifications of up to k + 1 tokens, cut drafts and lone decodes in the same step give
    the greedy tokens of the torch backend without drafts."""
    from pagedllm.attention.backends import triton_backend

    # Weights wide enough that attention decides the tokens (at HF's 0.02 this model repeats
    # one token whatever it attends to).
    _, model_config = make_tiny_model(
        LlamaConfig,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        hidden_size=64,
        initializer_range=0.3,
    )
    rng = random.Random(0)
    motif = [rng.randrange(3, 160) for _ in range(5)]
    # Repetitive prompts (drafts found and accepted) beside random ones (few drafts).
    prompts = [motif * 6, [rng.randrange(3, 160) for _ in range(23)], motif[::-1] * 5, [7, 8, 9] * 9]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    common = dict(device="cpu", block_size=16, max_model_len=96, max_num_seqs=4)
    reference = LLM(model_config.model, attention_backend="torch", **common)
    expected = reference.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)

    groups_seen = []
    launch = triton_backend.paged_decode

    def spy(*args, **kwargs):
        if kwargs.get("max_query_len", 1) > 1:
            groups_seen.append(kwargs["query_lens"].clone())
        return launch(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "paged_decode", spy)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(model_config.model, attention_backend="triton", speculative_config=spec, **common)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    for g, e in zip(got, expected):  # every verified row's distribution, not only its argmax
        for got_step, expected_step in zip(g.outputs[0].logprobs, e.outputs[0].logprobs):
            assert got_step.keys() == expected_step.keys()
            for token, logprob in got_step.items():
                assert logprob.logprob == pytest.approx(expected_step[token].logprob, abs=1e-4)
    assert llm.llm_engine.scheduler.spec_decoding.num_accepted_tokens > 0
    # Verifications of 4 tokens ran as groups, their other sequences at 0.
    assert any((lens == 4).any() and (lens == 0).any() for lens in groups_seen)
