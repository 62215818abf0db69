"""Long context end to end: sliding windows, ALiBi, soft-capping and rope scaling, against
Hugging Face ``generate`` (greedy, float32, CPU), with prompts longer than the windows.

Every family that needs this machinery runs as a tiny random model (head_dim 64, so the Triton
kernels take it too) through ``LLM``: the torch backend under every scheduling condition
(block sizes 8 and 16, chunked prefill, prefix caching, forced preemption), the Triton backend
(under the interpreter) on a smaller grid to stay fast.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import (
    BloomConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from pagedllm import LLM, SamplingParams

LONG = {"max_position_embeddings": 512}
HEAD64 = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}

# name: (config class, overrides). Windows of 16-32 tokens; prompts of 112-160 (PROMPT_LENS).
CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "mistral-window32-dynamic": (
        MistralConfig,
        {**LONG, **HEAD64, "sliding_window": 32, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
    ),
    # The 160-token prompt's decode steps cross the original length, where the factors switch (a
    # prompt longer than it would not match: see rotary_embedding.py).
    "llama-longrope": (
        LlamaConfig,
        {
            **LONG,
            **HEAD64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 164,
                "short_factor": [1.0 + 0.05 * i for i in range(32)],
                "long_factor": [1.5 + 0.5 * i for i in range(32)],
            },
        },
    ),
    # Layer 0 global, layer 1 sliding: Qwen2's max_window_layers.
    "qwen2-window16-layer1": (
        Qwen2Config,
        {**LONG, **HEAD64, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
    ),
    "qwen3-window24-yarn": (
        Qwen3Config,
        {
            **LONG,
            **HEAD64,
            "use_sliding_window": True,
            "sliding_window": 24,
            "max_window_layers": 0,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    # Caps small enough to bite on random weights.
    "gemma2-window16-softcap": (
        Gemma2Config,
        {
            **LONG,
            **HEAD64,
            "sliding_window": 16,
            "query_pre_attn_scalar": 32,
            "attn_logit_softcapping": 1.5,
            "final_logit_softcapping": 3.0,
        },
    ),
    "gemma3-window16-local-rope": (
        Gemma3TextConfig,
        {
            **LONG,
            **HEAD64,
            "sliding_window": 16,
            "query_pre_attn_scalar": 64,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            },
        },
    ),
    "gpt2": (GPT2Config, {**LONG, "hidden_size": 128, "num_attention_heads": 2}),
    "bloom-alibi": (BloomConfig, {**LONG, "hidden_size": 128, "num_attention_heads": 2}),
}

MAX_TOKENS = 8


# Prompt lengths: every one longer than the windows; the first two fill whole 16-token blocks (7 and
# 10), so a cache of 17 blocks admits both and preempts one at their first decode step.
PROMPT_LENS = (112, 160, 130)


def long_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    # The second prompt repeats the first's 96 tokens: prefix caching hits its blocks.
    prompts[1][:96] = prompts[0][:96]
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


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def case_model(make_tiny_model_for_module: Callable) -> Callable[[str], tuple[str, list, list]]:
    """case -> (model directory, prompts, HF greedy outputs), built once per case per module."""
    built: dict[str, tuple[str, list, list]] = {}

    def get(case: str) -> tuple[str, list, list]:
        if case not in built:
            config_class, overrides = CASES[case]
            hf_model, model_config = make_tiny_model_for_module(config_class, **overrides)
            prompts = long_prompts(model_config.vocab_size, seed=list(CASES).index(case))
            built[case] = (model_config.model, prompts, hf_greedy(hf_model, prompts, MAX_TOKENS))
        return built[case]

    return get


def generate(model: str, prompts: list[list[int]], **engine_kwargs: Any) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model, device="cpu", **{"max_model_len": 512, **engine_kwargs})
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


# (block size, chunked prefill, prefix caching, KV blocks): roomy, chunked, cached, and a cache
# so small that requests are preempted.
TORCH_CONDITIONS = {
    "b8": dict(block_size=8),
    "b16-chunked": dict(
        block_size=16, enable_chunked_prefill=True, max_num_batched_tokens=48, max_num_seqs=4
    ),
    "b8-prefix-cached": dict(block_size=8, enable_prefix_caching=True),
    "b16-preempted": dict(block_size=16, num_kv_blocks=17, max_model_len=272, swap_space=0.01),
}


@pytest.mark.parametrize("condition", list(TORCH_CONDITIONS))
@pytest.mark.parametrize("case", list(CASES))
def test_torch_backend_greedy_equals_hf(case_model: Callable, case: str, condition: str) -> None:
    model, prompts, expected = case_model(case)
    kwargs = TORCH_CONDITIONS[condition]
    llm, got = generate(model, prompts, attention_backend="torch", **kwargs)
    assert got == expected
    if "num_kv_blocks" in kwargs:
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0


@pytest.mark.parametrize("case", list(CASES))
def test_triton_backend_greedy_equals_hf(case_model: Callable, case: str) -> None:
    model, prompts, expected = case_model(case)
    # Chunks of 48 tokens, the second prompt's prefix cached, blocks of 8: every windowed path.
    _, got = generate(
        model,
        prompts[:2],
        attention_backend="triton",
        block_size=8,
        enable_chunked_prefill=True,
        max_num_batched_tokens=48,
        max_num_seqs=4,
        enable_prefix_caching=True,
    )
    assert got == expected[:2]
