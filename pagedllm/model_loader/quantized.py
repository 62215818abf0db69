"""Give each layer of a model its quantization method before its weights load (the methods make
the checkpoint's tensors: layers/quantization), from the checkpoint's ``quantization_config``."""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.layers.quantization.registry import get_quantization_config


def checkpoint_prefixes(model: nn.Module, name: str) -> list[str]:
    """The checkpoint modules a layer of ours holds: q_proj, k_proj and v_proj for a qkv_proj, and
    the checkpoint's name of a mixture-of-experts block (Mixtral's ``block_sparse_moe``)."""
    moe_module = getattr(model, "moe_module", "mlp")
    if ".mlp.experts" in name or name.endswith(".mlp.gate"):
        name = name.replace(".mlp.", f".{moe_module}.")
    head, _, last = name.rpartition(".")
    sources = getattr(model, "packed_modules_mapping", {}).get(last)
    if sources is None:
        return [name]
    return [f"{head}.{source}" for source, _ in sources]


def attach_quant_methods(
    model: nn.Module, quant_config: QuantizationConfig, checkpoint_names: Collection[str] = ()
) -> None:
    """Set ``quant_method`` on every layer the checkpoint quantized and make its tensors;
    ``checkpoint_names``: the checkpoint's tensor names (empty for dummy weights)."""
    checkpoint_names = frozenset(checkpoint_names)
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and module.quantizable:
            method = quant_config.get_linear_method(module, checkpoint_prefixes(model, name))
        elif isinstance(module, FusedMoE):
            method = quant_config.get_moe_method(
                module, checkpoint_prefixes(model, name)[0], checkpoint_names
            )
        else:
            continue
        if method is not None:
            method.create_weights(module)
            module.quant_method = method


def resolve_quantization(model_config: ModelConfig) -> QuantizationConfig | None:
    """The safetensors checkpoint's quantization (None for GGUF files and dense checkpoints)."""
    if model_config.gguf_file is not None or model_config.model.endswith(".gguf"):
        if model_config.quantization not in ("auto", "gguf", "none"):
            raise ValueError(
                f"quantization={model_config.quantization!r} applies to safetensors checkpoints; a GGUF "
                "file takes 'auto', 'gguf' or 'none'"
            )
        return None
    return get_quantization_config(model_config.hf_config, model_config.quantization)
