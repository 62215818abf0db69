"""Weights and config of a llama.cpp GGUF file, dequantized through the ``gguf`` package.

Every tensor is dequantized to float32 and cast to the run dtype, so a quantized file runs as the
dense model it approximates (the same numbers transformers computes from it), except the linear
layers and embedding tables that ``keep_linear_weights_quantized`` and ``keep_embedding_quantized``
gave a quantized method: their tensors are loaded as the file's raw blocks
(layers/quantization/gguf.py). Tensor names are
llama.cpp's (``blk.0.attn_q.weight``); they are mapped back to Hugging Face names by inverting
gguf's own HF -> GGUF name map over the names our model takes.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import struct
from collections.abc import Iterable, Iterator
from typing import Any

import gguf
import numpy as np
import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from pagedllm.cache_dir import save_atomically
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.onednn_linear import onednn_available
from pagedllm.layers.quantization.gguf import (
    EMBEDDING_BLOCK_BYTES,
    GGUFEmbeddingMethod,
    GGUFQ4LinearMethod,
    unsupported_reason,
)
from pagedllm.layers.utils import CheckpointSlice, CheckpointTensor
from pagedllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model_loader.gguf_reader import GGUFFile, GGUFTensor
from pagedllm.tokenizer import gguf_cache_path

logger = logging.getLogger(__name__)

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


def read_gguf_architecture(reader: GGUFFile) -> str:
    """The file's ``general.architecture``; ValueError unless we support it."""
    architecture = reader.fields.get("general.architecture")
    if architecture is None:
        raise ValueError("the GGUF file has no general.architecture")
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
def open_gguf(path: str) -> GGUFFile:
    """The file's metadata and tensor table, parsed once per process (the config and the weights
    both need it)."""
    try:
        return GGUFFile(path)
    except (OSError, ValueError, KeyError, IndexError, struct.error) as e:
        # A bad magic or a truncated header: name the file.
        raise ValueError(f"cannot read the GGUF file {path!r}: {e}") from e


def _field(reader: GGUFFile, key: str) -> Any:
    return reader.fields.get(key)


def load_gguf_config(path: str) -> PretrainedConfig:
    """The transformers config that the GGUF metadata describes, with ``architectures`` set.

    Derived once per file and cached as JSON (``gguf_cache_path``): later starts read it back as
    a plain ``PretrainedConfig`` holding every field, which spares the metadata parse and, above
    all, the import of the model's config class. In transformers 5 that import pulls in its
    activations, kernel hub and ``torch.distributed.tensor``: about 2 s and 150 MB of resident
    memory for the embedded model, a third of ``make run``'s start. Only configs whose class adds
    nothing but fields are cached: no attribute aliases (``attribute_map``), no properties.
    """
    cached = gguf_cache_path(path, "gguf-configs", f".{_derivation_key()}.json")
    if os.path.isfile(cached):
        try:
            with open(cached) as f:
                return PretrainedConfig.from_dict(json.load(f))
        except (OSError, ValueError) as e:  # unreadable or not JSON: derived again, rewritten
            logger.warning("ignoring the cached config %s (%s)", cached, e)
    config = _derive_gguf_config(path)
    if _fields_only(type(config)):

        def write(staging: str) -> None:
            with open(staging, "w") as f:
                json.dump(config.to_dict(), f)

        save_atomically(cached, write, "the GGUF's config")
    return config


@functools.cache
def _derivation_key() -> str:
    """This module's source, hashed into the cached config's name: a change to the derivation
    below never meets a config cached by the code before it."""
    try:
        with open(__file__, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:12]
    except OSError:  # no source beside the module (a zipped install): the package version
        return f"v{importlib.metadata.version('pagedllm')}"


def _fields_only(config_class: type) -> bool:
    """The class adds fields to ``PretrainedConfig`` and nothing a plain one would lack."""
    added = [k for k in config_class.__mro__ if k not in PretrainedConfig.__mro__]
    has_property = any(isinstance(v, property) for k in added for v in vars(k).values())
    return not getattr(config_class, "attribute_map", None) and not has_property


def _derive_gguf_config(path: str) -> PretrainedConfig:
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
    values["vocab_size"] = _field(reader, f"{architecture}.vocab_size") or reader.array_lengths.get(
        "tokenizer.ggml.tokens"
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


def _rope_parameters(reader: GGUFFile, architecture: str) -> dict[str, Any]:
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
    path: str,
    model: nn.Module,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    raw_names: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, CheckpointTensor]]:
    """(Hugging Face name, checkpoint tensor) of every tensor in the file, one at a time.

    Tensors named in ``raw_names`` come whole as their raw blocks, uint8 [rows, row_bytes]. The
    others come as CheckpointSlices, dequantized (to ``dtype``, on the CPU) when a weight loader
    reads them, and only the rows their region covers: a tensor-parallel rank dequantizes its own
    shard of a column-parallel weight (a row-parallel one needs every row, cut after). ``model``
    says which Hugging Face names exist (see ``_checkpoint_names``).
    """
    reader = open_gguf(os.path.abspath(path))
    architecture = read_gguf_architecture(reader)
    hf_names = _gguf_to_hf_names(architecture, hf_config.num_hidden_layers, _checkpoint_names(model))
    for tensor in reader.tensors:
        if tensor.name not in hf_names:
            raise ValueError(f"GGUF tensor {tensor.name!r} matches no parameter of {type(model).__name__}")
        hf_name = hf_names[tensor.name]
        permuted = hf_config if architecture == "llama" else None
        if hf_name in raw_names:
            weight = torch.from_numpy(np.array(tensor.data))
            # A row permutation: whole rows of raw blocks move the same way.
            yield hf_name, weight if permuted is None else _undo_rope_permute(hf_name, weight, permuted)
        else:
            yield hf_name, _gguf_slice(tensor, hf_name, permuted, dtype)
    # Unmap the file: its pages would otherwise stay in this process's resident memory.
    open_gguf.cache_clear()


def _gguf_slice(
    tensor: GGUFTensor, hf_name: str, permuted_config: PretrainedConfig | None, dtype: torch.dtype
) -> CheckpointSlice:
    """The tensor as a CheckpointSlice; ``permuted_config`` is set for llama files, whose q/k rows
    are un-permuted as they are read."""
    shape = tuple(tensor.data.shape)
    if tensor.data.dtype == np.uint8:  # blocks of a quantized type: the last dimension is bytes
        shape = tuple(gguf.quants.quant_shape_from_byte_shape(shape, tensor.tensor_type))

    def read_region(region: tuple[slice, ...]) -> torch.Tensor:
        # Rows (of dimension 0) are whole quantization blocks, so they dequantize on their own.
        weight = _dequantize(tensor, region[0], dtype)
        if permuted_config is not None:
            weight = _undo_rope_permute(hf_name, weight, permuted_config)
        return weight[(slice(None), *region[1:])]

    return CheckpointSlice(shape, read_region)


def keep_linear_weights_quantized(
    path: str, model: nn.Module, hf_config: PretrainedConfig, strict: bool
) -> frozenset[str]:
    """Give every linear layer whose GGUF tensors have a quantized kernel its quantized method
    (before loading); returns the Hugging Face names of the tensors to load raw.

    A layer without one stays dense (one notice for all of them), or, when ``strict`` (the user
    asked for quantization), is a ValueError naming it.
    """
    reader = open_gguf(os.path.abspath(path))
    architecture = read_gguf_architecture(reader)
    hf_names = _gguf_to_hf_names(architecture, hf_config.num_hidden_layers, _checkpoint_names(model))
    tensor_types = {hf_names.get(t.name): t.tensor_type.name for t in reader.tensors}
    raw_names: set[str] = set()
    dense: list[str] = []
    for name, layer in model.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        sources = list(_checkpoint_sources(model, f"{name}.weight"))
        types = {tensor_types.get(source) for source in sources}
        output_size, input_size = layer.weight.shape
        reason = (
            unsupported_reason(types.pop(), output_size, input_size)
            if len(types) == 1
            else f"its tensors mix GGML types {sorted(map(str, types))}"
        )
        if reason is not None:
            if strict:
                raise ValueError(f"quantization='gguf' cannot keep {name} quantized: {reason}")
            dense.append(f"{name} ({reason})")
            continue
        method = GGUFQ4LinearMethod(next(tensor_types[s] for s in sources))
        method.create_weights(layer)
        layer.quant_method = method
        raw_names.update(sources)
    if dense:
        logger.warning("%d linear layers run dequantized, e.g. %s", len(dense), dense[0])
    return frozenset(raw_names)


def keep_embedding_quantized(
    path: str, model: nn.Module, hf_config: PretrainedConfig, dtype: torch.dtype
) -> frozenset[str]:
    """Give each embedding table whose GGUF type lookups can dequantize row by row its quantized
    method (before loading); returns the Hugging Face names of the tensors to load raw.

    A tied LM head multiplies the whole table: it stays quantized only where the CPU worker gives
    the head a dense blocked copy of its own (oneDNN), else every step would dequantize it.
    """
    reader = open_gguf(os.path.abspath(path))
    architecture = read_gguf_architecture(reader)
    hf_names = _gguf_to_hf_names(architecture, hf_config.num_hidden_layers, _checkpoint_names(model))
    tensor_types = {hf_names.get(t.name): t.tensor_type.name for t in reader.tensors}
    raw_names: set[str] = set()
    for name, layer in model.named_modules():
        if not isinstance(layer, VocabParallelEmbedding) or isinstance(layer, ParallelLMHead):
            continue
        tensor_type = tensor_types.get(f"{name}.weight")
        is_tied_head = getattr(model, "lm_head", None) is layer
        if tensor_type not in EMBEDDING_BLOCK_BYTES or (is_tied_head and not onednn_available(dtype)):
            continue
        method = GGUFEmbeddingMethod(tensor_type)
        method.create_weights(layer)
        layer.quant_method = method
        raw_names.add(f"{name}.weight")
    return frozenset(raw_names)


def _checkpoint_names(model: nn.Module) -> Iterator[str]:
    """The Hugging Face checkpoint names that ``model.load_weights`` takes: its parameter names
    with each packed parameter expanded into its sources, plus the LM head (tied models skip it)."""
    yield "lm_head.weight"
    for name, _ in model.named_parameters():
        yield from _checkpoint_sources(model, name)


def _checkpoint_sources(model: nn.Module, param_name: str) -> Iterator[str]:
    """The checkpoint names loaded into parameter ``param_name`` (several for a packed one).
    Experts are stacked per projection, as GGUF stores them (``...mlp.experts.gate_proj.weight``)."""
    packed_modules = getattr(model, "packed_modules_mapping", {})
    packed = next((p for p in packed_modules if f".{p}." in param_name), None)
    experts, is_experts, stacked = param_name.rpartition(".experts.")
    if is_experts:
        projections = ("gate_proj", "up_proj") if stacked == "gate_up_proj" else ("down_proj",)
        yield from (f"{experts}.experts.{projection}.weight" for projection in projections)
    elif packed is None:
        yield param_name
    else:
        yield from (param_name.replace(f".{packed}.", f".{source}.") for source, _ in packed_modules[packed])


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


def _dequantize(tensor: GGUFTensor, rows: slice, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` (of dimension 0) as a CPU tensor in ``dtype`` and PyTorch's shape order (the reader
    already reversed ggml's).

    Dequantized 4096 rows at a time: a whole float32 copy of a large table (the embedding) would
    double its size at the load's peak.
    """
    data = tensor.data[rows]
    flat = data.reshape(-1, data.shape[-1])
    out: torch.Tensor | None = None
    for i in range(0, flat.shape[0], 4096):
        chunk = torch.from_numpy(np.array(gguf.quants.dequantize(flat[i : i + 4096], tensor.tensor_type)))
        if out is None:
            out = torch.empty(flat.shape[0], chunk.shape[-1], dtype=dtype)
        out[i : i + 4096] = chunk
    if out is None:
        return torch.empty(*data.shape[:-1], 0, dtype=dtype)
    return out.view(*data.shape[:-1], -1)


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

    weight: whole heads of q_proj/k_proj, [num_rows, ...] (a weight, its bias, or its raw blocks),
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
