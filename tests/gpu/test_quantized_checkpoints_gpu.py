"""Quantized checkpoints whose layers fall back to dequantized weights on CUDA (integer experts of
AWQ, GPTQ and compressed-tensors MoE checkpoints; compressed-tensors W8A8-INT8) served on the GPU
in float32: greedy output equal to HF's on the CPU with the same dequantized weights
(tests/model_loader/test_quantized_checkpoints.py checks the CPU path, logits included)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton kernels", allow_module_level=True)

from pagedllm import LLM, SamplingParams
from tests.model_loader.quant_writers import (
    write_awq,
    write_compressed_tensors,
    write_compressed_tensors_group_order,
    write_gptq,
)

pytestmark = pytest.mark.gpu

MOE = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2}
MODELS = {
    "qwen3_moe": (Qwen3MoeConfig, {**MOE, "head_dim": 16, "num_experts": 4, "moe_intermediate_size": 32}),
    "mixtral": (MixtralConfig, {**MOE, "num_local_experts": 4, "intermediate_size": 32}),
    "llama": (LlamaConfig, {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}),
}
INT8 = {
    "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
    "input_activations": {
        "num_bits": 8,
        "type": "int",
        "strategy": "token",
        "dynamic": True,
        "symmetric": True,
    },
}
CHECKPOINTS = {
    "awq-qwen3_moe": lambda model, out, _: write_awq(model, out, group=16),
    "gptq-desc-act-mixtral": lambda model, out, _: write_gptq(model, out, group=16),
    "ct-group-order-qwen3_moe": lambda model, out, _: write_compressed_tensors_group_order(
        model, out, group=16, symmetric=False
    ),
    "ct-w8a8-int8-llama": lambda model, out, calibration: write_compressed_tensors(
        model, out, INT8, "int-quantized", calibration
    ),
}


@pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
def test_dequantized_fallbacks_serve_hf_s_greedy_tokens_on_the_gpu(
    make_tiny_model, tmp_path, checkpoint
) -> None:
    config_class, overrides = MODELS[checkpoint.rpartition("-")[2]]
    hf_model, _ = make_tiny_model(config_class, **overrides)
    prompts = [
        torch.randint(hf_model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (5, 9, 13)
    ]
    calibration = torch.tensor([[token for prompt in prompts for token in prompt]])
    reference = CHECKPOINTS[checkpoint](hf_model, tmp_path / "quantized", calibration)
    reference.generation_config.eos_token_id = None
    reference.generation_config.pad_token_id = 0
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
            expected.append(ids[0, len(prompt) :].tolist())
    llm = LLM(str(tmp_path / "quantized"), device="cuda", dtype="float32", gpu_memory_utilization=0.2)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    finally:
        llm.llm_engine.shutdown()
