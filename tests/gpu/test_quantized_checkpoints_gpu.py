"""Quantized checkpoints whose layers fall back to dequantized weights on CUDA (integer experts of
AWQ, GPTQ and compressed-tensors MoE checkpoints; compressed-tensors W8A8-INT8) served on the GPU
in float32: greedy output equal to HF's on the CPU with the same dequantized weights
(tests/model_loader/test_quantized_checkpoints.py checks the CPU path, logits included)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton kernels", allow_module_level=True)

from pagedllm import LLM, SamplingParams
from tests.model_loader.quant_writers import write_compressed_tensors
from tests.model_loader.quantized_checks import (
    ARCHITECTURES,
    COMPRESSED_TENSORS_SCHEMES,
    MIXTRAL,
    MOE_WRITERS,
    QWEN3_MOE,
)

pytestmark = pytest.mark.gpu

# The CPU tests' tiny architectures with heads of 64, the smallest head size the Triton kernels take.
MODELS = {
    name: (config_class, {**overrides, "head_dim": 64})
    for name, (config_class, overrides) in {
        "qwen3_moe": QWEN3_MOE,
        "mixtral": MIXTRAL,
        "llama": ARCHITECTURES["llama"],
    }.items()
}
CHECKPOINTS = {
    "awq-qwen3_moe": lambda model, out, _: MOE_WRITERS["awq"](model, out),
    "gptq-desc-act-mixtral": lambda model, out, _: MOE_WRITERS["gptq-desc-act"](model, out),
    "ct-group-order-qwen3_moe": lambda model, out, _: MOE_WRITERS["compressed-tensors-group-order"](
        model, out
    ),
    "ct-w8a8-int8-llama": lambda model, out, calibration: write_compressed_tensors(
        model, out, *COMPRESSED_TENSORS_SCHEMES["w8a8-int8-channel-dynamic"], calibration
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
