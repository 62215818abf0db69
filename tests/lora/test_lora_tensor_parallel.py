"""LoRA at two tensor-parallel CPU ranks (gloo, the "mp" executor): A and B sharded with their
projection (B's rows by head for q/k/v, a KV head replicated on both ranks; A's columns for o and
down) give PEFT's merged model's greedy tokens, as one rank does; and at two pipeline stages, each
loading the adapters' weights of its own layers."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = {
    "gqa-split": {"num_attention_heads": 4, "num_key_value_heads": 2},
    "kv1-replicated-bias": {"num_attention_heads": 4, "num_key_value_heads": 1, "attention_bias": True},
}


@pytest.mark.parametrize(
    "case, sizes",
    [
        pytest.param(case, {"tensor_parallel_size": 2}, marks=pytest.mark.slow, id=f"tp2-{case}")
        for case in CASES
    ]
    + [
        pytest.param("gqa-split", {"pipeline_parallel_size": 2, "async_scheduling": True}, id="pp2-gqa-split")
    ],
)
def test_two_ranks_with_adapters_give_peft_merged_tokens(
    make_tiny_model, make_adapter, peft_merged, hf_greedy_tokens, make_prompts, case, sizes
):
    hf_model, model_config = make_tiny_model(LlamaConfig, **CASES[case])
    loras = [
        LoRARequest("all", 1, make_adapter(hf_model, 8, ALL_TARGETS)),
        LoRARequest("kv", 2, make_adapter(hf_model, 4, ["k_proj", "v_proj", "down_proj"])),
    ]
    choices = [loras[0], None, loras[1], loras[0]]
    prompts = make_prompts(len(choices), model_config.vocab_size, seed=11)
    options = dict(device="cpu", swap_space=0.01, enable_lora=True, max_loras=2, max_lora_rank=8)
    llm = LLM(model_config.model, **options, **sizes)
    outputs = llm.generate(
        prompt_token_ids=prompts, sampling_params=GREEDY, lora_request=choices, use_tqdm=False
    )
    merged = {lora.lora_int_id: peft_merged(hf_model, lora.lora_path) for lora in loras}
    for prompt, lora, output in zip(prompts, choices, outputs):
        reference = merged[lora.lora_int_id] if lora else hf_model
        assert output.outputs[0].token_ids == hf_greedy_tokens(reference, prompt, GREEDY.max_tokens), lora
    llm.llm_engine.shutdown()
