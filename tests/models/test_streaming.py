"""Bounded KV memory behind sliding windows, and attention sinks (StreamingLLM, Xiao et al. 2023).

A model whose every layer slides frees the blocks behind its window: a request holds at most
ceil(window / block_size) + 1 of them however long it runs, plus its sinks' blocks with
``attention_sinks``, which also lets generation run past max_model_len. The sinks' policy is
checked against Hugging Face directly: in a one-layer model a token's K/V depend on its embedding
and position only, so StreamingLLM's cache (the sinks, then the window's last tokens, at their
places in the cache) is exactly one HF forward over those tokens with positions 0, 1, ...
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import BloomConfig, GPT2Config, LlamaConfig, MistralConfig

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs

BLOCK_SIZE = 16


def make_engine(model: str, **kwargs: Any) -> LLM:
    return LLM(model, device="cpu", attention_backend="torch", block_size=BLOCK_SIZE, **kwargs)


def run_checking_blocks(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, bound: int
) -> list[list[int]]:
    """Generate step by step; after every step no running request holds more than ``bound``
    blocks. Returns each request's tokens; all blocks are free at the end."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=prompt, sampling_params=params)
    kv = engine.scheduler.kv_cache_manager
    outputs: dict[str, list[int]] = {}
    most_held = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
        for request in engine.scheduler.running:
            most_held = max(most_held, len(kv.get_blocks(request)))
    assert 0 < most_held <= bound
    assert kv.get_num_free_gpu_blocks() == kv.num_total_gpu_blocks
    return [outputs[str(i)] for i in range(len(prompts))]


@pytest.mark.slow
def test_a_windowed_model_holds_a_bounded_number_of_blocks(make_tiny_model: Any) -> None:
    window, num_tokens = 32, 4000
    _, model_config = make_tiny_model(MistralConfig, sliding_window=window, max_position_embeddings=4200)
    llm = make_engine(model_config.model, max_model_len=4100, async_scheduling=True)
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    outputs = run_checking_blocks(llm, [[1, 2, 3, 4, 5]], params, bound=-(-window // BLOCK_SIZE) + 1)
    assert len(outputs[0]) == num_tokens


def streaming_llm_greedy(
    hf_model: Any, prompt: list[int], num_tokens: int, sinks: int, window: int
) -> list[int]:
    """StreamingLLM's greedy continuation of a one-layer HF model: each token is predicted from the
    sinks and the window's last tokens, positioned by their place in the cache."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            last = len(tokens) - 1
            if last - window + 1 <= sinks:
                kept = tokens
            else:
                kept = tokens[:sinks] + tokens[last - window + 1 :]
            logits = hf_model(torch.tensor([kept]), position_ids=torch.arange(len(kept))[None]).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize(
    "backend, engine_kwargs",
    [
        ("torch", {}),
        (
            "torch",
            {
                "enable_chunked_prefill": True,
                "max_num_batched_tokens": 16,
                "max_num_seqs": 4,
                "enable_prefix_caching": True,
            },
        ),
        ("torch", {"async_scheduling": True}),
        ("triton", {}),
    ],
    ids=["torch", "torch-chunked-prefix-cached", "torch-async", "triton"],
)
@pytest.mark.slow
def test_sinks_equal_streaming_llm_past_max_model_len(
    make_tiny_model: Any, backend: str, engine_kwargs: dict
) -> None:
    sinks, window, max_model_len, num_tokens = 4, 24, 64, 150
    hf_model, model_config = make_tiny_model(
        LlamaConfig, num_hidden_layers=1, head_dim=64, num_attention_heads=2, num_key_value_heads=1
    )
    # The third prompt repeats the first's first 32 tokens: a prefix-cache hit when caching.
    prompts = [
        [(7 * i + 3) % 160 for i in range(40)],
        [5, 9, 2],
        [(7 * i + 3) % 160 for i in range(32)] + [1, 2],
    ]
    expected = [streaming_llm_greedy(hf_model, p, num_tokens, sinks, window) for p in prompts]
    llm = LLM(
        model_config.model,
        device="cpu",
        attention_backend=backend,
        block_size=8,
        max_model_len=max_model_len,
        sliding_window=window,
        attention_sinks=sinks,
        **engine_kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    # One sink block (of 8), the window's 3 blocks and the one being filled.
    got = run_checking_blocks(llm, prompts, params, bound=1 + 3 + 1)
    assert got == expected


@pytest.mark.slow  # an engine driven through many preemptions: 9 s here
def test_windowed_requests_preempt_without_changing_outputs(make_tiny_model: Any) -> None:
    """Behind a window a request holds a few blocks, so only siblings that fork (n > 1) outgrow a
    small cache: seeded samples come out the same whether they are swapped or recomputed."""
    _, model_config = make_tiny_model(MistralConfig, sliding_window=16, max_position_embeddings=256)
    prompts = [[(11 * i + j) % 160 for i in range(20 + 9 * j)] for j in range(6)]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)

    def run(**kwargs: Any) -> tuple[list, Any]:
        llm = make_engine(model_config.model, max_model_len=256, **kwargs)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outputs], llm.llm_engine.get_stats()

    reference, stats = run()
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute == 0
    swapped, stats = run(num_kv_blocks=16, swap_space=1.0)
    assert stats.num_preemptions_swap > 0
    recomputed, stats = run(num_kv_blocks=16, swap_space=0.0)
    assert stats.num_preemptions_recompute > 0
    assert swapped == recomputed == reference


@pytest.mark.parametrize(
    "config_class, kwargs, match",
    [
        (LlamaConfig, dict(sliding_window=0), "sliding_window"),
        (LlamaConfig, dict(sliding_window=-3), "sliding_window"),
        (LlamaConfig, dict(sliding_window=300, max_model_len=256), "sliding_window"),
        (LlamaConfig, dict(attention_sinks=4), "attention_sinks"),
        (LlamaConfig, dict(sliding_window=32, attention_sinks=-1), "attention_sinks"),
        (LlamaConfig, dict(sliding_window=32, attention_sinks=2.5), "attention_sinks"),
        (LlamaConfig, dict(sliding_window="32"), "sliding_window"),
        (LlamaConfig, dict(sliding_window=True), "sliding_window"),
        (LlamaConfig, dict(sliding_window=240, attention_sinks=4, max_model_len=256), "max_model_len"),
        (GPT2Config, dict(sliding_window=32, attention_sinks=4), "attention_sinks"),
        (BloomConfig, dict(sliding_window=32, attention_sinks=4), "attention_sinks"),
        (GPT2Config, dict(sliding_window=32), "sliding_window"),
    ],
)
def test_bad_window_and_sinks_are_refused_naming_the_field(
    make_tiny_model: Any, config_class: type, kwargs: dict, match: str
) -> None:
    overrides = {} if config_class is LlamaConfig else {"hidden_size": 128, "num_attention_heads": 2}
    _, model_config = make_tiny_model(config_class, max_position_embeddings=256, **overrides)
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=model_config.model, device="cpu", **kwargs).create_engine_config()
