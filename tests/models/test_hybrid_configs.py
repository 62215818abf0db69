"""The hybrid models' benchmark configs (benchmarks/configs/: Qwen3-Next-style W6, Qwen3.5 dense
and MoE, a Nemotron-H-style Mamba-2 hybrid): each builds on the meta device, as the GPU worker
sizes a model before loading it (estimate_model_bytes), with the parameter count its name gives,
and keeps a state per request that does not depend on the context length."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoConfig

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.entrypoints.bench.workloads import CONFIG_DIR
from pagedllm.model_loader import estimate_model_bytes
from pagedllm.models import get_model_class

# (config, parameters in billions (benchmarks/README.md's), linear layers, attention layers)
CONFIGS = [
    ("qwen3-next-2b", 2.68, 18, 6),
    ("qwen3.5-9b", 9, 24, 8),
    ("qwen3.5-35b-a3b", 35, 30, 10),
    ("nemotron-h-8b", 8, 24, 4),
]


@pytest.mark.parametrize(("name", "billions", "num_linear", "num_attention"), CONFIGS)
def test_hybrid_config_builds_on_meta_with_its_size(
    name: str, billions: float, num_linear: int, num_attention: int
) -> None:
    path = os.path.join(CONFIG_DIR, name)
    hf_config = AutoConfig.from_pretrained(path)
    model_config = ModelConfig(path, path, hf_config, torch.bfloat16, 4096, skip_tokenizer_init=True)
    params = estimate_model_bytes(model_config, TorchAttentionBackend) / 2
    assert abs(params / 1e9 - billions) / billions < 0.05, params
    model_class = get_model_class(hf_config.architectures, hf_config.model_type)
    assert model_class.num_attention_layers(hf_config) == num_attention
    shapes = model_class.state_shapes(hf_config, 1)
    assert len(shapes) == num_linear
    hf_config.max_position_embeddings *= 8  # the state is per request, not per token
    assert model_class.state_shapes(hf_config, 1) == shapes
