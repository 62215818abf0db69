"""Pipeline parallelism over two GPUs (NCCL: activations point to point, the samples broadcast on
a group of their own): in float32 two stages give the greedy tokens of one GPU, with two
micro-batches in flight (asynchronous scheduling) and one step at a time."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from pagedllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.two_gpus,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(
    "config_class, overrides",
    [
        # Three layers over two stages (2 + 1), a tied LM head: the last stage keeps the embedding.
        (
            LlamaConfig,
            {
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "num_hidden_layers": 3,
                "tie_word_embeddings": True,
            },
        ),
        (Qwen3Config, {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128}),
    ],
    ids=["llama-3-layers-tied", "qwen3-head128"],
)
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["micro-batches", "one-step"])
def test_two_stages_give_the_greedy_tokens_of_one_gpu(
    make_tiny_model, config_class, overrides, async_scheduling
):
    _, model_config = make_tiny_model(config_class, **overrides)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, model_config.vocab_size) for _ in range(rng.randint(2, 60))] for _ in range(12)
    ]
    # A fixed cache: profiling would count the first engine's cached memory against the second.
    kwargs = dict(device="cuda", dtype="float32", num_kv_blocks=512, max_num_seqs=8)
    one = LLM(model_config.model, enforce_eager=True, **kwargs)
    expected = [
        o.outputs[0].token_ids for o in one.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    ]
    one.llm_engine.shutdown()
    del one
    torch.cuda.empty_cache()

    two = LLM(model_config.model, pipeline_parallel_size=2, async_scheduling=async_scheduling, **kwargs)
    try:
        outputs = two.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        stats = two.llm_engine.get_stats()
        assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    finally:
        two.llm_engine.shutdown()
