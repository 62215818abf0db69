"""The engine with the LoRA kernels (interpreted on the CPU under TRITON_INTERPRET=1, as on CUDA
but without graphs) against the masked torch product, the CPU path PEFT checks: 18 requests over
two adapters and the base, so that prefill steps run SGMV over their tiles, decode steps of 16
or more tokens SGMV over the fixed grid, and the last decodes BGMV."""

from __future__ import annotations

import functools

import pytest
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.triton import lora, lora_sgmv
from pagedllm.lora import model_manager
from pagedllm.lora.punica import LoRABatch
from pagedllm.lora.request import LoRARequest


@pytest.mark.slow
def test_the_kernels_give_the_masked_products_tokens(
    make_tiny_model, make_adapter, make_prompts, monkeypatch
):
    hf_model, model_config = make_tiny_model(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    loras = [
        LoRARequest("a", 1, make_adapter(hf_model, 8, ["q_proj", "v_proj", "down_proj"])),
        LoRARequest("b", 2, make_adapter(hf_model, 4, ["k_proj", "o_proj", "gate_proj", "up_proj"])),
    ]
    choices = [loras[0], None, loras[1]] * 6
    prompts = make_prompts(len(choices), model_config.vocab_size, seed=3)
    # Requests finish one after another, so decode steps shrink below 16 tokens.
    params = [
        SamplingParams(temperature=0.0, max_tokens=4 + i % 9, ignore_eos=True) for i in range(len(choices))
    ]
    ran = set()  # which kernels ran: "bgmv", ("sgmv", fixed_grid)
    bgmv, sgmv = lora.bgmv_shrink, lora_sgmv.sgmv_shrink
    monkeypatch.setattr(lora, "bgmv_shrink", lambda *args: ran.add("bgmv") or bgmv(*args))
    monkeypatch.setattr(
        lora_sgmv, "sgmv_shrink", lambda *args: ran.add(("sgmv", args[3].fixed_grid)) or sgmv(*args)
    )
    outputs = {}
    for use_kernels in (False, True):
        monkeypatch.setattr(model_manager, "LoRABatch", functools.partial(LoRABatch, use_kernels=use_kernels))
        llm = LLM(model_config.model, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8)
        result = llm.generate(
            prompt_token_ids=prompts, sampling_params=params, lora_request=choices, use_tqdm=False
        )
        outputs[use_kernels] = [o.outputs[0].token_ids for o in result]
        llm.llm_engine.shutdown()
    assert ran == {"bgmv", ("sgmv", False), ("sgmv", True)}
    assert outputs[True] == outputs[False]
