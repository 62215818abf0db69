"""Tensor parallelism over two GPUs (NCCL, the "mp" executor): in float32 the greedy tokens of two
ranks equal one rank's, with CUDA graphs captured on both ranks and eagerly."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams

pytestmark = [
    pytest.mark.two_gpus,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prompts_for(vocab_size: int, n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 60))] for _ in range(n)]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    "config_class, overrides",
    [
        # One KV head replicated on both ranks, biases, an untied head.
        (
            LlamaConfig,
            {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "attention_bias": True},
        ),
        # GQA split over the ranks, per-head norms, head size 128, a vocabulary that splits unevenly.
        (
            Qwen3Config,
            {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 163},
        ),
    ],
    ids=["llama-kv1-bias", "qwen3-gqa-head128"],
)
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_two_gpus_give_the_greedy_tokens_of_one(make_tiny_model, config_class, overrides, enforce_eager):
    _, model_config = make_tiny_model(config_class, **overrides)
    prompts = prompts_for(model_config.vocab_size, 12)
    # A fixed cache: profiling would count the first engine's cached memory against the second.
    kwargs = dict(device="cuda", dtype="float32", enforce_eager=enforce_eager, num_kv_blocks=512)
    one = LLM(model_config.model, **kwargs)
    expected = token_ids(one.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False))
    one.llm_engine.shutdown()
    del one
    torch.cuda.empty_cache()

    two = LLM(model_config.model, tensor_parallel_size=2, **kwargs)
    try:
        outputs = two.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert token_ids(outputs) == expected
        stats = two.llm_engine.get_stats()
        assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    finally:
        two.llm_engine.shutdown()


def test_more_ranks_than_gpus_are_refused_before_loading(make_tiny_model):
    _, model_config = make_tiny_model(
        LlamaConfig, num_attention_heads=64, num_key_value_heads=64, hidden_size=256
    )
    num_gpus = torch.cuda.device_count()
    with pytest.raises(
        ValueError, match=f"tensor_parallel_size must be <= the {num_gpus} visible CUDA devices"
    ):
        LLM(model_config.model, device="cuda", tensor_parallel_size=2 * num_gpus)


@pytest.fixture(scope="module")
def llama_head64_with_tokenizer(tmp_path_factory, smollm2_tokenizer) -> str:
    """A tiny random Llama with SmolLM2's tokenizer and head size 64 (the GPU kernels' smallest),
    2 KV heads so that each rank holds one."""
    config = LlamaConfig(
        vocab_size=len(smollm2_tokenizer),
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=smollm2_tokenizer.eos_token_id,
    )
    path = tmp_path_factory.mktemp("llama-head64-tokenizer")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_two_gpus_share_rank_zeros_grammar_bitmask(llama_head64_with_tokenizer, enforce_eager):
    """Rank 0 keeps the grammars and broadcasts each step's bitmask over NCCL (its masks made
    ahead on the grammar thread): the constrained outputs of two ranks equal one rank's and stay
    inside their grammars; a rank under another mask would sample other tokens and the shards
    would stop adding up."""
    constraints = [
        StructuredOutputsParams(regex="(ab|c){1,3}x"),
        StructuredOutputsParams(choice=["alpha beta", "gamma"]),
        StructuredOutputsParams(
            json={
                "type": "object",
                "properties": {"n": {"type": "integer", "maximum": 99}},
                "required": ["n"],
            }
        ),
        None,
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=c) for c in constraints]
    prompts = [[10, 11, 12], [40, 41], [7, 8, 9, 10], [5, 6]]
    kwargs = dict(device="cuda", dtype="float32", enforce_eager=enforce_eager, num_kv_blocks=256)
    one = LLM(llama_head64_with_tokenizer, **kwargs)
    expected = [o.outputs[0].text for o in one.generate(prompt_token_ids=prompts, sampling_params=params)]
    one.llm_engine.shutdown()
    del one
    torch.cuda.empty_cache()
    two = LLM(llama_head64_with_tokenizer, tensor_parallel_size=2, **kwargs)
    try:
        texts = [o.outputs[0].text for o in two.generate(prompt_token_ids=prompts, sampling_params=params)]
    finally:
        two.llm_engine.shutdown()
    assert texts == expected
    assert re.fullmatch("(ab|c){1,3}x", texts[0])
    assert texts[1] in ("alpha beta", "gamma")
    assert isinstance(json.loads(texts[2]), dict)
