"""Quantized mixture-of-experts checkpoints on the CPU in float32, as AutoAWQ, GPTQModel and
llm-compressor publish them (every expert's projections quantized, one tensor set each): pagedllm's
tokens and logits equal transformers' on the same model with the dequantized experts; experts a
checkpoint stores dense load dense; shards that would cut a group or a packed word are refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.model_loader import get_model
from tests.model_loader.quant_writers import write_compressed_tensors
from tests.model_loader.quantized_checks import (
    COMPRESSED_TENSORS_SCHEMES,
    CPU,
    MOE_WRITERS,
    assert_same_greedy,
    assert_same_logits,
    calibration_ids,
)


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("checkpoint", sorted(MOE_WRITERS))
def test_quantized_experts_generate_as_hf_dequantized(tiny, paged_runner, architecture, checkpoint) -> None:
    hf_model, model_dir = tiny(architecture)
    reference = MOE_WRITERS[checkpoint](hf_model, model_dir)
    assert_same_greedy(reference, model_dir, paged_runner)
    assert_same_logits(reference, model_dir, paged_runner)


def test_compressed_tensors_experts_stay_dense_where_the_checkpoint_stores_them_dense(tiny) -> None:
    """compressed-tensors on transformers 5 quantizes the Linear modules, which its fused experts
    are not: the checkpoint stores them dense (one tensor per expert, as transformers saves them),
    and they load as such beside the quantized attention."""
    hf_model, model_dir = tiny("qwen3_moe")
    fields, fmt = COMPRESSED_TENSORS_SCHEMES["w4a16-sym-g32"]
    calibration = calibration_ids(hf_model.config.vocab_size)
    write_compressed_tensors(hf_model, model_dir, fields, fmt, calibration, with_reference=False)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in load_file(str(model_dir / "model.safetensors"))
    model_config = ModelConfig(
        str(model_dir), str(model_dir), AutoConfig.from_pretrained(model_dir), torch.float32, 256
    )
    model = get_model(model_config, "auto", CPU, TorchAttentionBackend)
    layer = model.model.layers[0]
    assert layer.mlp.experts.quant_method is None and layer.self_attn.qkv_proj.quant_method is not None
    expected = hf_model.model.layers[0].mlp.experts
    torch.testing.assert_close(layer.mlp.experts.gate_up_proj, expected.gate_up_proj, atol=0, rtol=0)
    torch.testing.assert_close(layer.mlp.experts.down_proj, expected.down_proj, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("group", "message"),
    [
        (32, r"group_size=32 does not divide FusedMoEProjection's input shard of 48 features"),
        (
            16,
            r"8 values per int32 word \(AWQ bits=4\) does not divide FusedMoEProjection's output shard of 12",
        ),
    ],
)
def test_quantized_experts_whose_shards_cut_a_group_or_a_word_are_refused(
    monkeypatch, group, message
) -> None:
    """down's inputs and gate/up's outputs are the experts' split features: a group or a packed
    word they would cut is refused before loading, naming the field."""
    from pagedllm.layers.fused_moe import layer as fused_moe_layer
    from pagedllm.layers.quantization.wna16 import AWQMethod, IntWeightScheme
    from pagedllm.layers.quantization.wna16_moe import IntWeightMoEMethod

    monkeypatch.setattr(fused_moe_layer, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(fused_moe_layer, "get_tensor_model_parallel_rank", lambda: 0)
    intermediate = 96 if group == 32 else 24  # per rank: 48 (32 does not divide it); 12 (not 8 words)
    experts = fused_moe_layer.FusedMoE(4, 2, 64, intermediate, renormalize=True)
    with pytest.raises(ValueError, match=message):
        IntWeightMoEMethod(lambda: AWQMethod(IntWeightScheme(4, group, symmetric=False))).create_weights(
            experts
        )
