"""Steps with prompt tokens replayed from CUDA graphs cut at the attention calls
(``cudagraph_mode="FULL_AND_PIECEWISE"``, worker/piecewise_graph.py), on a GPU, float32:

* greedy tokens are HF ``generate``'s, through chunked prefill (prompt chunks beside decodes, of
  many token counts, each padded to a chain's size) and prefix caching;
* sampled tokens and logprobs are those of the eager engine with the same seeds;
* n-gram drafts (verifications beside prompt chunks) change no token;
* the chains did replay, and a mixture of experts follows them too.
"""

from __future__ import annotations

import gc

import pytest
import torch
from test_engine_gpu import GREEDY, hf_greedy, prompts_for
from transformers import LlamaConfig, Qwen3MoeConfig

from pagedllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PIECEWISE = {
    "cudagraph_mode": "FULL_AND_PIECEWISE",
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 96,
    "max_num_seqs": 8,
}
MODELS = {
    "llama": (LlamaConfig, {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}),
    "qwen3moe": (
        Qwen3MoeConfig,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
        },
    ),
}


def _count_replays(llm: LLM) -> list[int]:
    runner = llm.llm_engine.executor.worker.model_runner.piecewise_runner
    assert runner is not None, "FULL_AND_PIECEWISE captured no chains"
    counts: list[int] = []
    replay = runner.replay
    runner.replay = lambda num_tokens, metadata: counts.append(num_tokens) or replay(num_tokens, metadata)
    return counts


def _release(llm: LLM) -> None:
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_greedy_through_the_chains_equals_hf(make_tiny_model, family, enable_prefix_caching):
    config_class, overrides = MODELS[family]
    hf_model, model_config = make_tiny_model(config_class, **overrides)
    prompts = prompts_for(model_config.vocab_size, 12, seed=3, lo=2, hi=150)
    prompts += [prompts[0] + prompts[1]]  # a shared prefix for the prefix cache
    llm = LLM(
        model_config.model,
        device="cuda",
        dtype="float32",
        enable_prefix_caching=enable_prefix_caching,
        gpu_memory_utilization=0.3,
        **PIECEWISE,
    )
    try:
        replays = _count_replays(llm)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outputs]
    finally:
        _release(llm)
    assert len(set(replays)) > 3, f"the chains replayed for too few step sizes: {sorted(set(replays))}"
    assert tokens == hf_greedy(hf_model, prompts, GREEDY.max_tokens)


def test_sampling_and_logprobs_equal_the_eager_engines(make_tiny_model):
    _, model_config = make_tiny_model(MODELS["llama"][0], **MODELS["llama"][1])
    prompts = prompts_for(model_config.vocab_size, 10, seed=4, lo=20, hi=120)
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, max_tokens=12, ignore_eos=True, logprobs=2)
        for i in range(len(prompts))
    ]
    got = {}
    for mode in ("eager", "piecewise"):
        options = {"enforce_eager": True} if mode == "eager" else PIECEWISE
        llm = LLM(model_config.model, device="cuda", dtype="float32", gpu_memory_utilization=0.3, **options)
        try:
            replays = _count_replays(llm) if mode == "piecewise" else None
            outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        finally:
            _release(llm)
        assert replays is None or replays
        got[mode] = [
            (c.token_ids, [{t: round(lp.logprob, 3) for t, lp in step.items()} for step in c.logprobs])
            for c in (o.outputs[0] for o in outputs)
        ]
    assert got["piecewise"] == got["eager"]


def test_ngram_verifications_beside_prompt_chunks_change_no_token(make_tiny_model):
    hf_model, model_config = make_tiny_model(MODELS["llama"][0], **MODELS["llama"][1])
    motif = prompts_for(model_config.vocab_size, 1, seed=5, lo=6, hi=6)[0]
    prompts = [motif * 8, *prompts_for(model_config.vocab_size, 6, seed=6, lo=30, hi=140), motif * 5]
    llm = LLM(
        model_config.model,
        device="cuda",
        dtype="float32",
        gpu_memory_utilization=0.3,
        # Drafting at every batch size (on a GPU n-gram stops at 2 running requests by default).
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None},
        **PIECEWISE,
    )
    try:
        replays = _count_replays(llm)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outputs]
        drafted = llm.llm_engine.get_stats().spec_decoding.num_draft_tokens
    finally:
        _release(llm)
    assert replays and drafted > 0
    assert tokens == hf_greedy(hf_model, prompts, GREEDY.max_tokens)
