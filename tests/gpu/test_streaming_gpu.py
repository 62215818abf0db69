"""Bounded windows and attention sinks end to end on CUDA: the triton and cuda backends in float32
against StreamingLLM computed by Hugging Face (tests/models/test_streaming.py says why a one-layer
model makes that exact), with CUDA graphs, past max_model_len, in bounded blocks."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton kernels", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_streaming import run_checking_blocks, streaming_llm_greedy
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_sinks_equal_streaming_llm_on_the_gpu(make_tiny_model: Any, backend: str) -> None:
    sinks, window, num_tokens = 4, 24, 150
    hf_model, model_config = make_tiny_model(
        LlamaConfig, num_hidden_layers=1, head_dim=64, num_attention_heads=2, num_key_value_heads=1
    )
    prompts = [[(7 * i + 3) % 160 for i in range(40)], [5, 9, 2]]
    expected = [streaming_llm_greedy(hf_model, p, num_tokens, sinks, window) for p in prompts]
    llm = LLM(
        model_config.model,
        device="cuda",
        dtype="float32",
        attention_backend=backend,
        block_size=8,
        max_model_len=64,
        num_kv_blocks=64,
        sliding_window=window,
        attention_sinks=sinks,
    )
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    assert run_checking_blocks(llm, prompts, params, bound=1 + 3 + 1) == expected
