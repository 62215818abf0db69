"""Context parallelism over two GPUs (NCCL, the "mp" executor, the Triton kernels): in float32
the greedy tokens of two ranks striping the KV cache equal one GPU's, with CUDA graphs (the
merge's all-gather captured in them) and eagerly, with chunked prefill over long prompts."""

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
        (LlamaConfig, {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64}),
        (
            Qwen3Config,
            {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 163},
        ),
    ],
    ids=["llama-kv1", "qwen3-gqa-head128"],
)
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_two_context_ranks_give_the_greedy_tokens_of_one_gpu(
    make_tiny_model, config_class, overrides, enforce_eager
):
    _, model_config = make_tiny_model(config_class, max_position_embeddings=1024, **overrides)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, model_config.vocab_size) for _ in range(rng.randint(2, 700))] for _ in range(10)
    ]
    kwargs = dict(
        device="cuda",
        dtype="float32",
        enforce_eager=enforce_eager,
        num_kv_blocks=512,
        max_num_batched_tokens=256,
        enable_chunked_prefill=True,
    )
    one = LLM(model_config.model, **kwargs)
    expected = [
        o.outputs[0].token_ids for o in one.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    ]
    one.llm_engine.shutdown()
    del one
    torch.cuda.empty_cache()

    two = LLM(model_config.model, context_parallel_size=2, **kwargs)
    try:
        outputs = two.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        stats = two.llm_engine.get_stats()
        assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    finally:
        two.llm_engine.shutdown()
