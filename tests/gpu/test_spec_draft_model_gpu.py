"""Speculative decoding with a draft model on a GPU, float32: greedy output is HF's with CUDA
graphs on and off (a graph step's padded inputs are cut to the real rows for the draft's eager
pass), the target as its own draft is accepted every time, and a draft of another family (other
head counts) changes no output; with prefix caching, chunked prefill and preemption too."""

from __future__ import annotations

import pytest
import torch
from test_engine_gpu import hf_greedy, prompts_for
from transformers import LlamaConfig, Qwen2Config

from pagedllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture
def models(make_tiny_model):
    """(HF target, its ModelConfig, {draft name: directory}); head size 64 for every kernel."""
    hf_model, model_config = make_tiny_model(
        LlamaConfig, num_attention_heads=4, num_key_value_heads=2, head_dim=64
    )
    _, qwen2 = make_tiny_model(
        Qwen2Config,
        vocab_size=model_config.vocab_size,
        hidden_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return hf_model, model_config, {"self": model_config.model, "qwen2-1-layer": qwen2.model}


@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("draft", ["self", "qwen2-1-layer"])
def test_greedy_with_a_draft_model_equals_hf_on_the_gpu(models, enforce_eager, draft):
    hf_model, model_config, drafts = models
    prompts = prompts_for(model_config.vocab_size, 12, seed=0)
    llm = LLM(
        model_config.model,
        device="cuda",
        dtype="float32",
        enforce_eager=enforce_eager,
        num_kv_blocks=512,
        speculative_config={"method": "draft_model", "model": drafts[draft], "num_speculative_tokens": 3},
    )
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf_model, prompts, GREEDY.max_tokens)
    spec = llm.llm_engine.scheduler.spec_decoding
    assert spec.num_draft_tokens > 0
    if draft == "self":
        assert spec.num_accepted_tokens == spec.num_draft_tokens


def test_the_target_as_its_own_draft_through_preemption_prefix_caching_and_chunks_on_the_gpu(models):
    hf_model, model_config, drafts = models
    shared = prompts_for(model_config.vocab_size, 1, seed=1, lo=20, hi=20)[0]
    prompts = [shared + p for p in prompts_for(model_config.vocab_size, 12, seed=2)]
    llm = LLM(
        model_config.model,
        device="cuda",
        dtype="float32",
        block_size=16,
        # 8 blocks of 16 tokens, one request's most (128 tokens): two of these requests fill it,
        # so running ones are preempted. The same requests on the CPU's torch backend: 10
        # preemptions at 8 blocks, none at 14 or 40 (a larger cache held them all).
        num_kv_blocks=8,
        max_model_len=128,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=48,
        max_num_seqs=16,
        speculative_config={"method": "draft_model", "model": drafts["self"], "num_speculative_tokens": 4},
    )
    expected = hf_greedy(hf_model, prompts, GREEDY.max_tokens)
    for _ in range(2):
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_recompute > 0 and stats.prefix_cache_hit_rate > 0
    spec = llm.llm_engine.scheduler.spec_decoding
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0
