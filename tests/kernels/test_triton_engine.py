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
