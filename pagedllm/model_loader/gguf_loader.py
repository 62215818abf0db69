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

from pagedllm.layers.utils import CheckpointSlice

# general.architecture -> the Hugging Face architecture we run it as (Mistral GGUFs say "llama";
# so do Mixtral's, told apart by their expert count).
SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# general.architecture -> (transformers model_type, architecture) of its mixture-of-experts files.
_MOE_ARCHITECTURES = {
    "llama": ("mixtral", "MixtralForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
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
    "expert_count": "num_experts",  # an alias of Mixtral's num_local_experts too
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
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
    return gguf.GGUFReader(path)


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
    model_type, hf_architecture = architecture, SUPPORTED_GGUF_ARCHITECTURES[architecture]
    if values.get("num_experts"):
        model_type, hf_architecture = _MOE_ARCHITECTURES[architecture]
        # llama.cpp's qwen3moe graph always renormalises the top-k weights (Mixtral's router does too).
        values["norm_topk_prob"] = True
    config = AutoConfig.for_model(model_type, **values)
    config.architectures = [hf_architecture]
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
) -> Iterator[tuple[str, CheckpointSlice]]:
    """(Hugging Face name, unread CheckpointSlice) of every tensor in the file, one at a time.

    A slice is dequantized (to ``dtype``, on the CPU) when a weight loader reads it, and only the
    rows its region covers: a tensor-parallel rank dequantizes its own shard of a column-parallel
    weight (a row-parallel one needs every row, cut after). ``model`` says which Hugging Face
    names exist (see ``_checkpoint_names``).
    """
    reader = open_gguf(os.path.abspath(path))
    architecture = read_gguf_architecture(reader)
    hf_names = _gguf_to_hf_names(architecture, hf_config.num_hidden_layers, _checkpoint_names(model))
    for tensor in reader.tensors:
        if tensor.name not in hf_names:
            raise ValueError(f"GGUF tensor {tensor.name!r} matches no parameter of {type(model).__name__}")
        hf_name = hf_names[tensor.name]
        permute = architecture == "llama" and _rope_permuted_heads(hf_name, hf_config) is not None
        yield hf_name, _gguf_slice(tensor, hf_name, hf_config if permute else None, dtype)


def _gguf_slice(
    tensor: gguf.ReaderTensor, hf_name: str, permuted_config: PretrainedConfig | None, dtype: torch.dtype
) -> CheckpointSlice:
    """The tensor as a CheckpointSlice; ``permuted_config`` is set for llama q/k rows to un-permute."""
    byte_shape = tuple(tensor.data.shape)
    quantized = tensor.tensor_type not in _UNQUANTIZED_TYPES
    shape = (
        gguf.quants.quant_shape_from_byte_shape(byte_shape, tensor.tensor_type) if quantized else byte_shape
    )

    def read_region(region: tuple[slice, ...]) -> torch.Tensor:
        # Rows are whole quantization blocks, so they dequantize on their own.
        weight = _dequantize(tensor, region[0])
        if permuted_config is not None:
            weight = _undo_rope_permute(hf_name, weight, permuted_config)
        return weight[(slice(None), *region[1:])].to(dtype)

    return CheckpointSlice(shape, read_region)


def _checkpoint_names(model: nn.Module) -> Iterator[str]:
    """The Hugging Face checkpoint names that ``model.load_weights`` takes: its parameter names
    with each packed parameter expanded into its sources, plus the LM head (tied models skip it).
    Experts are stacked per projection, as GGUF stores them (``...mlp.experts.gate_proj.weight``)."""
    packed_modules = getattr(model, "packed_modules_mapping", {})
    yield "lm_head.weight"
    for name, _ in model.named_parameters():
        packed = next((p for p in packed_modules if f".{p}." in name), None)
        experts, is_experts, stacked = name.rpartition(".experts.")
        if is_experts:
            projections = ("gate_proj", "up_proj") if stacked == "gate_up_proj" else ("down_proj",)
            yield from (f"{experts}.experts.{projection}.weight" for projection in projections)
        elif packed is None:
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


_UNQUANTIZED_TYPES = (
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
)


def _dequantize(tensor: gguf.ReaderTensor, rows: slice) -> torch.Tensor:
    """Float32 CPU tensor of ``rows`` (dimension 0) in PyTorch's shape order (gguf's reader
    already reversed ggml's)."""
    array = gguf.quants.dequantize(tensor.data[rows], tensor.tensor_type)
    if not array.flags.writeable:
        # Unquantized tensors come back as views of the read-only memory map; torch wants its own.
        array = np.array(array)
    return torch.from_numpy(array)


def _rope_permuted_heads(hf_name: str, hf_config: PretrainedConfig) -> int | None:
    """The number of heads of a q/k projection (whose rows llama.cpp permutes), else None."""
    if ".q_proj." in hf_name:
        return hf_config.num_attention_heads
    if ".k_proj." in hf_name:
        return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return None


def _undo_rope_permute(hf_name: str, weight: torch.Tensor, hf_config: PretrainedConfig) -> torch.Tensor:
    """llama.cpp's converter reorders each head's q/k rows from the neox rotary layout (halves) to
    the interleaved one its kernels use: row (i, j) of half i, pair j moves to (j, i). Undo it.

    weight: whole heads of q_proj/k_proj, [num_rows, hidden_size] (or of its bias, [num_rows]),
    num_rows a multiple of the head size: a tensor-parallel shard is a run of whole heads.
    """
    num_heads = _rope_permuted_heads(hf_name, hf_config)
    if num_heads is None:
        return weight
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if weight.shape[0] % head_size:
        raise ValueError(
            f"{hf_name}: {weight.shape[0]} rows are not whole heads of {head_size} (of {num_heads})"
        )
    interleaved = weight.reshape(weight.shape[0] // head_size, head_size // 2, 2, *weight.shape[1:])
    return interleaved.transpose(1, 2).reshape(weight.shape)
