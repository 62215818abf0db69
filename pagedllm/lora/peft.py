"""PEFT LoRA adapter directories: read, checked against the base model, loaded.

A directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ...) and ``adapter_model.safetensors``, whose tensors are named after the
module they adapt::

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [r, in_features]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   [out_features, r]

and the adapted projection computes ``W x + (B (A x)) * scaling`` with ``scaling = lora_alpha / r``
(rsLoRA, Kalajdzievski 2023: ``lora_alpha / sqrt(r)``).

Supported: the attention's q/k/v/o projections and the gated MLP's gate/up/down, at any rank up to
``max_lora_rank``. Refused, naming what: embeddings and the LM head (new vocabulary), DoRA,
trained biases, ``modules_to_save``, per-module ranks, and any tensor of a shape the base model
does not have. ``check_adapter`` reads only the JSON and the safetensors header (the engine runs
it before it queues a request); ``load_adapter`` reads the tensors (the workers run it).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.request import LoRARequest

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.\w+)?\.weight$")
# Module names that mean new vocabulary rows or a trained head: not supported.
_VOCAB_MODULES = ("embed_tokens", "lm_head", "wte", "word_embeddings", "embed_in", "embed_out")


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter is, read from its directory: its rank and scale, and per (layer, module)
    the shapes of A ``[r, in]`` and B ``[out, r]``."""

    rank: int
    scaling: float
    shapes: dict[tuple[int, str], tuple[tuple[int, ...], tuple[int, ...]]]

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _, module in self.shapes})


@dataclass
class AdapterWeights:
    """An adapter's tensors: per (layer, module), A ``[r, in]`` and B ``[out, r]`` with the scaling
    folded into B (so applying it is ``y += (x A^T) B^T``)."""

    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def check_adapter(
    lora_request: LoRARequest, hf_config: PretrainedConfig, lora_config: LoRAConfig
) -> AdapterSpec:
    """Read the adapter's config and tensor header and check them against the base model and the
    engine's limits. Raises ValueError naming the adapter and the field at fault."""
    path = lora_request.lora_path
    where = f"adapter {lora_request.lora_name!r} ({path})"
    config = _read_config(path, where)
    rank = _check_config(config, where, lora_config)
    shapes = _read_shapes(path, where)
    expected = expected_shapes(hf_config)
    for (layer, module), (a_shape, b_shape) in sorted(shapes.items()):
        if module not in expected:
            raise ValueError(
                f"{where}: adapts {module}, but the base model's MLP is a mixture of experts, whose "
                "projections LoRA does not adapt here (attention projections only)"
            )
        if layer >= hf_config.num_hidden_layers:
            raise ValueError(
                f"{where}: adapts layer {layer}, but the base model has {hf_config.num_hidden_layers}"
            )
        in_features, out_features = expected[module]
        if a_shape != (rank, in_features) or b_shape != (out_features, rank):
            raise ValueError(
                f"{where}: layer {layer} {module} has lora_A {list(a_shape)} and lora_B {list(b_shape)}, "
                f"but the base model needs [{rank}, {in_features}] and [{out_features}, {rank}] "
                "(trained on another model?)"
            )
    if not shapes:
        raise ValueError(f"{where}: {WEIGHTS_NAME} holds no LoRA tensors")
    return AdapterSpec(rank=rank, scaling=_scaling(config, rank), shapes=shapes)


def load_adapter(
    lora_request: LoRARequest, hf_config: PretrainedConfig, lora_config: LoRAConfig
) -> AdapterWeights:
    """The adapter's tensors (float32, on the host), checked as ``check_adapter`` does."""
    from safetensors.torch import load_file

    spec = check_adapter(lora_request, hf_config, lora_config)
    tensors = load_file(os.path.join(lora_request.lora_path, WEIGHTS_NAME))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, module, which = _parse_key(key, "")
        pairs.setdefault((layer, module), {})[which] = tensor.float()
    weights = {target: (ab["A"], ab["B"] * spec.scaling) for target, ab in pairs.items()}
    return AdapterWeights(rank=spec.rank, weights=weights)


def expected_shapes(hf_config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of the base model an adapter may target,
    unsharded."""
    hidden = hf_config.hidden_size
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // num_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    intermediate = getattr(hf_config, "intermediate_size", None) or 4 * hidden
    attention = {
        "q_proj": (hidden, num_heads * head_dim),
        "k_proj": (hidden, num_kv_heads * head_dim),
        "v_proj": (hidden, num_kv_heads * head_dim),
        "o_proj": (num_heads * head_dim, hidden),
    }
    if getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None):
        return attention  # a mixture of experts: no dense gate/up/down
    mlp = {
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }
    return attention | mlp


# --- reading ------------------------------------------------------------------------------------


def _read_config(path: str, where: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise ValueError(f"{where}: lora_path is not a directory")
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise ValueError(f"{where}: no {CONFIG_NAME} in lora_path (a PEFT adapter directory has one)")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: {CONFIG_NAME} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {CONFIG_NAME} must hold a JSON object")
    return config


def _check_config(config: dict[str, Any], where: str, lora_config: LoRAConfig) -> int:
    """The adapter's rank, after refusing what the engine does not run."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type must be 'LORA', got {peft_type!r}")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}: {CONFIG_NAME} field 'r' must be an int >= 1, got {rank!r}")
    if rank > lora_config.max_lora_rank:
        raise ValueError(f"{where}: rank r={rank} exceeds max_lora_rank={lora_config.max_lora_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{where}: {CONFIG_NAME} field 'lora_alpha' must be a number, got {alpha!r}")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "modules_to_save (fully trained modules, e.g. a new LM head) is not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D weights) is not supported",
    }
    for field, why in refused.items():
        if config.get(field):
            raise ValueError(f"{where}: {why} ({field}={config[field]!r})")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: trained biases are not supported (bias={config['bias']!r}, need 'none')")
    targets = config.get("target_modules") or []
    named = [targets] if isinstance(targets, str) else list(targets)
    vocab = [t for t in named if any(v in t for v in _VOCAB_MODULES)]
    if vocab:
        raise ValueError(
            f"{where}: target_modules {vocab} adapt the embeddings or the LM head (extra vocabulary), "
            f"which is not supported; supported: {list(SUPPORTED_MODULES)}"
        )
    return rank


def _scaling(config: dict[str, Any], rank: int) -> float:
    alpha = float(config.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _read_shapes(path: str, where: str) -> dict[tuple[int, str], tuple[tuple[int, ...], tuple[int, ...]]]:
    from safetensors import safe_open

    weights_path = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(weights_path):
        bin_path = os.path.join(path, "adapter_model.bin")
        hint = " (adapter_model.bin is a pickle, which is not loaded: save with safe_serialization)"
        raise ValueError(
            f"{where}: no {WEIGHTS_NAME} in lora_path" + (hint if os.path.exists(bin_path) else "")
        )
    try:
        with safe_open(weights_path, framework="pt") as f:
            raw = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118 (a safe_open handle is not iterable)
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise ValueError(f"{where}: {WEIGHTS_NAME} cannot be read: {e}") from e
    pairs: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, shape in raw.items():
        layer, module, which = _parse_key(key, where)
        pairs.setdefault((layer, module), {})[which] = shape
    shapes = {}
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"{where}: layer {layer} {module} has no {missing} tensor")
        shapes[(layer, module)] = (ab["A"], ab["B"])
    return shapes


def _parse_key(key: str, where: str) -> tuple[int, str, str]:
    """(layer, module, "A" or "B") of a PEFT tensor name; ValueError for what is not supported."""
    match = _KEY.search(key)
    if match is None or match.group(3) not in SUPPORTED_MODULES:
        what = (
            "the embeddings or the LM head (extra vocabulary)"
            if any(v in key for v in _VOCAB_MODULES)
            else key
        )
        raise ValueError(
            f"{where}: tensor {key!r} adapts {what}, which is not supported; supported target modules: "
            f"{list(SUPPORTED_MODULES)}"
        )
    return int(match.group(1)), match.group(3), match.group(4)
