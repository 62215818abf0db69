"""Multi-LoRA end to end on the CPU, float32: a batch mixing adapters of different ranks, targets
and scalings with base-model requests gives, for each request, PEFT's merged model's greedy
output (HF ``generate``), on two architectures."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, Qwen3Config

from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

ARCHITECTURES = {
    "llama-gqa": (LlamaConfig, {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "qwen3-qknorm": (
        Qwen3Config,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True},
    ),
}

# (rank, targets, options): attention only, MLP only, everything with rsLoRA.
ADAPTERS = [
    (8, ["q_proj", "v_proj"], {}),
    (4, ["gate_proj", "up_proj", "down_proj"], {"alpha": 8.0}),
    (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], {"use_rslora": True}),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_mixed_adapters_in_one_batch_equal_peft_merged(
    make_tiny_model, make_adapter, peft_merged, hf_greedy_tokens, make_prompts, arch
):
    config_class, overrides = ARCHITECTURES[arch]
    hf_model, model_config = make_tiny_model(config_class, **overrides)
    dirs = [make_adapter(hf_model, rank, targets, **opts) for rank, targets, opts in ADAPTERS]
    loras = [LoRARequest(f"adapter{i}", i + 1, d) for i, d in enumerate(dirs)]
    # Two requests per adapter and two without, interleaved: one batch holds all of them.
    choices = [None, *loras, *loras, None]
    prompts = make_prompts(len(choices), model_config.vocab_size, seed=3)
    llm = LLM(model_config.model, device="cpu", enable_lora=True, max_loras=3, max_lora_rank=16, block_size=8)
    outputs = llm.generate(
        prompt_token_ids=prompts, sampling_params=GREEDY, lora_request=choices, use_tqdm=False
    )

    references = {
        None: hf_model,
        **{lora.lora_int_id: peft_merged(hf_model, lora.lora_path) for lora in loras},
    }
    for prompt, lora, output in zip(prompts, choices, outputs):
        reference = references[lora.lora_int_id if lora else None]
        assert output.outputs[0].token_ids == hf_greedy_tokens(reference, prompt, GREEDY.max_tokens), lora
    # The adapters change the outputs (else the comparison above proves nothing).
    base_outputs = [hf_greedy_tokens(hf_model, p, GREEDY.max_tokens) for p in prompts[1:4]]
    assert all(o.outputs[0].token_ids != b for o, b in zip(outputs[1:4], base_outputs))


@pytest.mark.slow
def test_chat_runs_with_the_adapter(tiny_llama_with_tokenizer, make_adapter):
    from transformers import AutoModelForCausalLM

    from pagedllm.tokenizer import apply_chat_template

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_with_tokenizer, dtype="float32")
    lora = LoRARequest("chatty", 1, make_adapter(hf_model, 8, ["q_proj", "o_proj", "up_proj"], alpha=64.0))
    llm = LLM(tiny_llama_with_tokenizer, device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8)
    messages = [{"role": "user", "content": "Name a color."}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    chat = llm.chat(messages, params, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids
    prompt = apply_chat_template(llm.get_tokenizer(), messages, True)
    generated = llm.generate(
        prompt_token_ids=[prompt], sampling_params=params, lora_request=lora, use_tqdm=False
    )
    assert chat == generated[0].outputs[0].token_ids
    assert chat != llm.chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids
