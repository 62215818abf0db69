"""End to end on the GPU: the engine on the cuda backend generates what it generates on triton.

A tiny random Llama (GQA, head size 64) in float32, greedy, ragged prompts: the token ids must be
equal with attention_backend="cuda" and "triton", for plain batches, chunked prefill (prompts split
over steps, so chunks attend to cached prefixes), prefix caching (prompts sharing a prefix reuse its
blocks) and each block size the kernels support.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton kernels", allow_module_level=True)

from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def ragged_prompts(n: int, vocab_size: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(vocab_size) for _ in range(rng.randint(1, 60))] for _ in range(n)]


def generate(
    model_dir: str, backend: str, prompts: list[list[int]], **engine_args: object
) -> list[list[int]]:
    llm = LLM(
        model_dir,
        device="cuda",
        dtype="float32",
        attention_backend=backend,
        num_kv_blocks=256,
        enforce_eager=True,
        **engine_args,
    )
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    "engine_args, shared_prefix",
    [
        ({}, 0),
        ({"enable_chunked_prefill": True, "max_num_batched_tokens": 48, "max_num_seqs": 8}, 0),
        ({"enable_prefix_caching": True}, 40),
        ({"block_size": 8}, 0),
        ({"block_size": 32}, 0),
    ],
    ids=["plain", "chunked-prefill", "prefix-caching", "block8", "block32"],
)
def test_greedy_cuda_equals_triton(make_tiny_model, engine_args: dict, shared_prefix: int) -> None:
    _, model_config = make_tiny_model(LlamaConfig, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    prompts = ragged_prompts(12, model_config.vocab_size, seed=len(engine_args), shared_prefix=shared_prefix)
    triton = generate(model_config.model, "triton", prompts, **engine_args)
    cuda = generate(model_config.model, "cuda", prompts, **engine_args)
    assert cuda == triton
    assert all(len(ids) == GREEDY.max_tokens for ids in cuda)
