"""What the quantized-checkpoint tests share (here and on the GPU): the tiny architectures, the
compressed-tensors schemes and MoE writers they quantize with, and the checks of pagedllm's output
against the reference (transformers on the same model with the tool's dequantized weights)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, LlamaConfig, MixtralConfig, PreTrainedModel, Qwen3Config, Qwen3MoeConfig

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.model_loader import get_model
from tests.model_loader.quant_writers import (
    write_awq,
    write_compressed_tensors_fp8,
    write_compressed_tensors_group_order,
    write_gptq,
)

CPU = torch.device("cpu")
PROMPT_LENS = (5, 9, 13)
MAX_TOKENS = 8
# Tiny families: q 64, kv 32, hidden 64, intermediate 96 or 128 (whole blocks of 16, groups of 32).
ARCHITECTURES = {
    "llama": (LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)),
    "qwen3": (Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
}
QWEN3_MOE = (
    Qwen3MoeConfig,
    dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
)

MIXTRAL = (
    MixtralConfig,
    dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
    ),
)
FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
FP8_STATIC = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
COMPRESSED_TENSORS_SCHEMES = {
    "w8a8-fp8-channel-dynamic": (
        {
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
            "input_activations": FP8_TOKEN,
        },
        "float-quantized",
    ),
    "w8a8-fp8-tensor-static": (
        {
            "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
            "input_activations": FP8_STATIC,
        },
        "float-quantized",
    ),
    "w8a8-int8-channel-dynamic": (
        {
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "strategy": "token",
                "dynamic": True,
                "symmetric": True,
            },
        },
        "int-quantized",
    ),
    "w8a8-int8-tensor-static": (
        {
            "weights": {"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": True},
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "strategy": "tensor",
                "dynamic": False,
                "symmetric": True,
            },
        },
        "int-quantized",
    ),
    "w4a16-sym-g32": (
        {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}},
        "pack-quantized",
    ),
    "w4a16-asym-g16": (
        {
            "weights": {
                "num_bits": 4,
                "type": "int",
                "strategy": "group",
                "group_size": 16,
                "symmetric": False,
            }
        },
        "pack-quantized",
    ),
    # llm-compressor's GPTQ default: columns quantized in activation order, groups kept in place.
    "w4a16-asym-g32-actorder-static": (
        {
            "weights": {
                "num_bits": 4,
                "type": "int",
                "strategy": "group",
                "group_size": 32,
                "symmetric": False,
                "actorder": "static",
            }
        },
        "pack-quantized",
    ),
    "w4a16-asym-channel": (
        {"weights": {"num_bits": 4, "type": "int", "strategy": "channel", "symmetric": False}},
        "pack-quantized",
    ),
    "w8a16-int-sym-g32": (
        {"weights": {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}},
        "pack-quantized",
    ),
    "w8a16-fp8-block": (
        {
            "weights": {
                "num_bits": 8,
                "type": "float",
                "strategy": "block",
                "block_structure": [16, 16],
                "symmetric": True,
            }
        },
        "float-quantized",
    ),
}


# Mixture-of-experts checkpoints as AutoAWQ, GPTQModel and llm-compressor publish them: every
# expert's projections quantized, one tensor set each (the router stays dense).
MOE_WRITERS = {
    "awq": lambda model, out: write_awq(model, out, group=16),
    "gptq-desc-act": lambda model, out: write_gptq(model, out, group=16, desc_act=True),
    "gptq": lambda model, out: write_gptq(model, out, group=16, desc_act=False),
    "compressed-tensors-asym": lambda model, out: write_compressed_tensors_group_order(
        model, out, group=16, symmetric=False, g_idx=False
    ),
    "compressed-tensors-group-order": lambda model, out: write_compressed_tensors_group_order(
        model, out, group=16, symmetric=True
    ),
    "compressed-tensors-fp8-channel": lambda model, out: write_compressed_tensors_fp8(model, out, "channel"),
    "compressed-tensors-fp8-tensor": lambda model, out: write_compressed_tensors_fp8(model, out, "tensor"),
    "compressed-tensors-fp8-block": lambda model, out: write_compressed_tensors_fp8(model, out, "block"),
}


def make_prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENS]


def hf_greedy(reference: PreTrainedModel, prompts: list[list[int]]) -> list[list[int]]:
    reference.generation_config.eos_token_id = None  # run the whole length, as ignore_eos
    reference.generation_config.pad_token_id = 0
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
            outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


def paged_greedy(model_dir: Path, paged_runner: type, quantization: str = "auto") -> list[list[int]]:
    """pagedllm's greedy tokens: one ragged prefill of every prompt, then decode steps."""
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_config = ModelConfig(
        str(model_dir), str(model_dir), hf_config, torch.float32, 256, quantization=quantization
    )
    model = get_model(model_config, "auto", CPU, TorchAttentionBackend)
    runner = paged_runner(model, model_config)
    prompts = make_prompts(hf_config.vocab_size)
    logits = runner.step(dict(enumerate(prompts)))
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(MAX_TOKENS):
        tokens = {i: int(rows[-1].argmax()) for i, rows in logits.items()}
        for i, token in tokens.items():
            outputs[i].append(token)
        if step + 1 < MAX_TOKENS:
            logits = runner.step({i: [token] for i, token in tokens.items()})
    return outputs


def calibration_ids(vocab_size: int) -> torch.Tensor:
    return torch.tensor([[token for prompt in make_prompts(vocab_size) for token in prompt]])


def assert_same_greedy(
    reference: PreTrainedModel, model_dir: Path, paged_runner: type, **options: str
) -> None:
    prompts = make_prompts(reference.config.vocab_size)
    assert paged_greedy(model_dir, paged_runner, **options) == hf_greedy(reference, prompts)


def assert_same_logits(reference: PreTrainedModel, model_dir: Path, paged_runner: type) -> None:
    """The prompts' logits equal the reference's: a tiny random model's greedy tokens survive
    small weight errors (scales taken from the wrong groups, say), its logits do not."""
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_config = ModelConfig(str(model_dir), str(model_dir), hf_config, torch.float32, 256)
    model = get_model(model_config, "auto", CPU, TorchAttentionBackend)
    prompts = make_prompts(hf_config.vocab_size)
    logits = paged_runner(model, model_config).step(dict(enumerate(prompts)))
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            expected = reference(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(logits[i], expected, atol=1e-4, rtol=1e-4)
