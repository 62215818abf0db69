"""Long context end to end: sliding windows, ALiBi, soft-capping and rope scaling, against
Hugging Face ``generate`` (greedy, float32, CPU), with prompts longer than the windows.

Every family that needs this machinery runs as a tiny random model (``long_context_case`` in
tests/conftest.py: head_dim 64, so the Triton kernels take it too) through ``LLM``: the torch
backend under every scheduling condition (block sizes 8 and 16, chunked prefill, prefix caching,
forced preemption), the Triton backend (under the interpreter) on one condition that exercises all
its windowed paths, to stay fast. tests/gpu/test_long_context_gpu.py runs the same cases on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def case_model(long_context_model: Callable) -> Callable[[str], tuple[str, list, list]]:
    """case -> (model directory, prompts, HF greedy outputs), built once per case per module."""
    return lambda case: long_context_model(case, MAX_TOKENS, "cpu")


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
def test_torch_backend_greedy_equals_hf(case_model: Callable, long_context_case: str, condition: str) -> None:
    model, prompts, expected = case_model(long_context_case)
    kwargs = TORCH_CONDITIONS[condition]
    llm, got = generate(model, prompts, attention_backend="torch", **kwargs)
    assert got == expected
    # A model whose every layer slides frees its blocks behind the window, so one greedy sequence
    # per prompt never outgrows the cache; tests/models/test_streaming.py preempts such models
    # with forking siblings.
    if "num_kv_blocks" in kwargs and llm.llm_engine.scheduler.kv_cache_manager.sliding_window is None:
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0


# Slow (10-15 s a case): the interpreted Triton kernels end to end; the kernels' own tests and the
# torch backend's HF equality of every case (four conditions, above) run in make test.
@pytest.mark.slow
def test_triton_backend_greedy_equals_hf(case_model: Callable, long_context_case: str) -> None:
    model, prompts, expected = case_model(long_context_case)
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
