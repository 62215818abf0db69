"""Weights and config of a llama.cpp GGUF file, dequantized through the ``gguf`` package.

Every tensor is dequantized to float32 and cast to the run dtype, so a quantized file runs as the
dense model it approximates (the same numbers transformers computes from it). Tensor names are
llama.cpp's (``blk.0.attn_q.weight``); they are mapped back to Hugging Face names by inverting
gguf's own HF -> GGUF name map over the names our model takes.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Iterator
from typing import Any

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


# "<architecture>.<key>" metadata -> the transformers config field it sets.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
}
_TOKEN_ID_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}


@functools.lru_cache(maxsize=2)
def open_gguf(path: str) -> gguf.GGUFReader:
    """The file's reader, parsed once per process: parsing walks every vocabulary string and takes
    seconds, and the config and the weights both need it."""
    try:
        return gguf.GGUFReader(path)
    except (OSError, ValueError, KeyError, IndexError) as e:
        # gguf's errors (bad magic, a truncated file) name no file.
        raise ValueError(f"cannot read the GGUF file {path!r}: {e}") from e


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def load_gguf_config(path: str) -> PretrainedConfig:
    """The transformers config that the GGUF metadata describes, with ``architectures`` set."""
    reader = open_gguf(os.path.abspath(path))
    architecture = read_gguf_architecture(reader)
    values: dict[str, Any] = {}
    for key, name in {
        **{f"{architecture}.{k}": v for k, v in _CONFIG_KEYS.items()},
        **_TOKEN_ID_KEYS,
    }.items():
        value = _field(reader, key)
        if value is not None:
            values[name] = value
    values["vocab_size"] = _field(reader, f"{architecture}.vocab_size") or len(
        reader.get_field("tokenizer.ggml.tokens").data
    )
    # llama.cpp stores no output.weight when the LM head is the embedding.
    values["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    values["rope_parameters"] = _rope_parameters(reader, architecture)
    config = AutoConfig.for_model(architecture, **values)
    config.architectures = [SUPPORTED_GGUF_ARCHITECTURES[architecture]]
    return config


def _rope_parameters(reader: gguf.GGUFReader, architecture: str) -> dict[str, Any]:
    params: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": _field(reader, f"{architecture}.rope.freq_base"),
    }
    if params["rope_theta"] is None:
        params["rope_theta"] = 10000.0
    scaling = _field(reader, f"{architecture}.rope.scaling.type")
    if scaling not in (None, "none"):
        params["rope_type"] = scaling
        params["factor"] = _field(reader, f"{architecture}.rope.scaling.factor")
        original = _field(reader, f"{architecture}.rope.scaling.original_context_length")
        if original is not None:
            params["original_max_position_embeddings"] = original
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # Llama 3.1 GGUFs carry their scaled frequencies as a tensor, not as llama3 parameters.
        raise NotImplementedError(
            "this GGUF scales rope frequencies through a rope_freqs tensor (Llama 3.1 style), which is "
            "not supported yet: load the HF safetensors checkpoint instead"
        )
    return params


def iterate_gguf_weights(
    path: str, model: nn.Module, hf_config: PretrainedConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, CPU tensor in ``dtype``) of every tensor in the file, one at a time.

    ``model`` says which Hugging Face names exist (see ``_checkpoint_names``).
    """
    reader = open_gguf(os.path.abspath(path))
    architecture = read_gguf_architecture(reader)
    hf_names = _gguf_to_hf_names(architecture, hf_config.num_hidden_layers, _checkpoint_names(model))
    for tensor in reader.tensors:
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
