"""Weights and config of a llama.cpp GGUF file, dequantized through the ``gguf`` package.

Every tensor is dequantized to float32 and cast to the run dtype, so a quantized file runs as the
dense model it approximates (the same numbers transformers computes from it). Tensor names are
llama.cpp's (``blk.0.attn_q.weight``); they are mapped back to Hugging Face names by inverting
gguf's own HF -> GGUF name map over the names our model takes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import gguf
import numpy as np
import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

# general.architecture -> the Hugging Face architecture we run it as (Mistral GGUFs say "llama").
SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Tensors llama.cpp stores but we derive from the config (Llama 3.1's scaled rope frequencies).
_DERIVED_TENSORS = frozenset({"rope_freqs.weight"})


def read_gguf_architecture(reader: gguf.GGUFReader) -> str:
    """The file's ``general.architecture``; ValueError unless we support it."""
    field = reader.get_field("general.architecture")
    if field is None:
        raise ValueError("the GGUF file has no general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode("utf-8")
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        supported = sorted(SUPPORTED_GGUF_ARCHITECTURES)
        raise ValueError(f"GGUF architecture {architecture!r} is not supported; supported: {supported}")
    return architecture


def load_gguf_config(path: str) -> PretrainedConfig:
    """The transformers config of a GGUF file, with ``architectures`` set (GGUF metadata has none)."""
    architecture = read_gguf_architecture(gguf.GGUFReader(path))
    directory, name = os.path.split(os.path.abspath(path))
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    config.architectures = [SUPPORTED_GGUF_ARCHITECTURES[architecture]]
    return config


def iterate_gguf_weights(
    path: str, model: nn.Module, hf_config: PretrainedConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, CPU tensor in ``dtype``) of every tensor in the file, one at a time.

    ``model`` says which Hugging Face names exist (see ``_checkpoint_names``).
    """
    reader = gguf.GGUFReader(path)
    architecture = read_gguf_architecture(reader)
    hf_names = _gguf_to_hf_names(architecture, hf_config.num_hidden_layers, _checkpoint_names(model))
    for tensor in reader.tensors:
        if tensor.name in _DERIVED_TENSORS:
            continue
        if tensor.name not in hf_names:
            raise ValueError(f"GGUF tensor {tensor.name!r} matches no parameter of {type(model).__name__}")
        hf_name = hf_names[tensor.name]
        weight = _dequantize(tensor)
        if architecture == "llama":
            weight = _undo_rope_permute(hf_name, weight, hf_config)
        yield hf_name, weight.to(dtype)


def _checkpoint_names(model: nn.Module) -> Iterator[str]:
    """The Hugging Face checkpoint names that ``model.load_weights`` takes: its parameter names
    with each packed parameter expanded into its sources, plus the LM head (tied models skip it)."""
    packed_modules = getattr(model, "packed_modules_mapping", {})
    yield "lm_head.weight"
    for name, _ in model.named_parameters():
        packed = next((p for p in packed_modules if f".{p}." in name), None)
        if packed is None:
            yield name
        else:
            yield from (name.replace(f".{packed}.", f".{source}.") for source, _ in packed_modules[packed])


def _gguf_to_hf_names(architecture: str, num_layers: int, hf_names: Iterable[str]) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, for the given Hugging Face names."""
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture)
    name_map = gguf.get_tensor_name_map(arch, num_layers)
    mapping: dict[str, str] = {}
    for hf_name in hf_names:
        module, _, suffix = hf_name.rpartition(".")  # suffix: "weight" or "bias"
        gguf_module = name_map.get_name(module)
        if gguf_module is not None:
            mapping[f"{gguf_module}.{suffix}"] = hf_name
    return mapping


def _dequantize(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """Float32 CPU tensor in PyTorch's shape order (gguf's reader already reversed ggml's)."""
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if not array.flags.writeable:
        # Unquantized tensors come back as views of the read-only memory map; torch wants its own.
        array = np.array(array)
    return torch.from_numpy(array)


def _undo_rope_permute(hf_name: str, weight: torch.Tensor, hf_config: PretrainedConfig) -> torch.Tensor:
    """llama.cpp's converter reorders each head's q/k rows from the neox rotary layout (halves) to
    the interleaved one its kernels use: row (i, j) of half i, pair j moves to (j, i). Undo it.

    weight: q_proj/k_proj [num_heads * head_size, hidden_size] (or its bias [num_heads * head_size]).
    """
    if ".q_proj." in hf_name:
        num_heads = hf_config.num_attention_heads
    elif ".k_proj." in hf_name:
        num_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    else:
        return weight
    head_size = weight.shape[0] // num_heads
    interleaved = weight.reshape(num_heads, head_size // 2, 2, *weight.shape[1:])
    return interleaved.transpose(1, 2).reshape(weight.shape)
