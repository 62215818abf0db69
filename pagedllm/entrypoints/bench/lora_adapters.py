"""Random LoRA adapters for benchmarks: PEFT directories of the served model's shapes.

``pagedllm bench throughput --num-loras K --lora-rank R`` spreads K such adapters over the
workload's requests (request i runs with adapter i mod K), every adapter targeting every
projection the engine adapts (q/k/v/o, and gate/up/down where the MLP is dense). The weights are
random (A and B ~ N(0, 0.01)): throughput does not depend on their values.
"""

from __future__ import annotations

import json
import os

import torch
from transformers import PretrainedConfig

from pagedllm.lora.peft import CONFIG_NAME, WEIGHTS_NAME, expected_shapes
from pagedllm.lora.request import LoRARequest


def write_random_adapters(
    hf_config: PretrainedConfig, num_loras: int, rank: int, directory: str, seed: int = 0
) -> list[LoRARequest]:
    """``num_loras`` PEFT adapter directories of rank ``rank`` under ``directory``."""
    from safetensors.torch import save_file

    shapes = expected_shapes(hf_config)
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for index in range(num_loras):
        path = os.path.join(directory, f"lora{index}")
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for layer in range(hf_config.num_hidden_layers):
            for module, (in_features, out_features) in shapes.items():
                block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = 0.01 * torch.randn(
                    rank, in_features, generator=generator
                )
                tensors[f"{prefix}.lora_B.weight"] = 0.01 * torch.randn(
                    out_features, rank, generator=generator
                )
        save_file(tensors, os.path.join(path, WEIGHTS_NAME))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(shapes)}
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            json.dump(config, f)
        requests.append(LoRARequest(f"lora{index}", index + 1, path))
    return requests
