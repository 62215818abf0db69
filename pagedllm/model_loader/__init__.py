"""Build a model on its device and fill its weights from a checkpoint or at random."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
from collections.abc import Callable, Iterator

import torch
from torch import nn

from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.layers.quantization import keeps_gguf_quantized
from pagedllm.model_loader.dummy_loader import initialize_dummy_weights
from pagedllm.model_loader.hf_loader import iterate_safetensors_weights, safetensors_names
from pagedllm.model_loader.quantized import attach_quant_methods, resolve_quantization
from pagedllm.models import get_model_class
from pagedllm.models.utils import CausalLM


def get_model(
    model_config: ModelConfig,
    load_format: str,
    device: torch.device,
    attn_backend: type[AttentionBackend],
    model_class: type[nn.Module] | None = None,
) -> nn.Module:
    """The model of ``model_config`` on ``device`` in ``model_config.dtype``, weights loaded, in eval mode.

    load_format: "safetensors" (HF directory), "gguf", "dummy" (random), or "auto" (gguf when the
    config names a GGUF file, else safetensors). model_class: the implementation, when the caller
    chooses it (an EAGLE head); else the one registered for the config's architecture.
    """
    if model_class is None:
        model_class = get_model_class(model_config.architectures, model_config.hf_config.model_type)
    quant_config = resolve_quantization(model_config)
    load_format = _resolve_load_format(model_config, load_format)
    with _large_host_buffers_mapped():
        # Parameters are created directly on the device in the run dtype: no float32 CPU copy of
        # an 8B model on the way.
        with _default_dtype(model_config.dtype), torch.device(device):
            model = model_class(model_config.hf_config, attn_backend)
            if isinstance(model, CausalLM):  # a pipeline stage keeps its own modules only
                model.keep_pipeline_stage()
            if quant_config is not None:
                # The checkpoint's names: a format may store a layer either way (dense or not).
                names = _checkpoint_names(model_config) if load_format == "safetensors" else ()
                attach_quant_methods(model, quant_config, names)
        with torch.no_grad():
            _load_weights(model, model_config, load_format, device)
            quantized = [m for m in model.modules() if getattr(m, "quant_method", None) is not None]
            for module in quantized:
                module.quant_method.process_weights_after_loading(module)
                _release_freed_heap()  # per layer: the freed raw blocks would otherwise pile up to the peak
            # Modules that derive tensors from their loaded weights (MLA's absorbed up-projections).
            for module in model.modules():
                if hasattr(module, "process_weights_after_loading"):
                    module.process_weights_after_loading()
    return model.eval()


# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@contextlib.contextmanager
def _large_host_buffers_mapped() -> Iterator[None]:
    """Loading with every host buffer of 128 KB or more in a mapping of its own, returned to the
    OS when freed (glibc's ``M_MMAP_THRESHOLD``).

    glibc raises that threshold (up to 32 MB) each time such a buffer is freed, so without this
    the loader's temporaries (raw blocks, decoded nibbles, dequantized chunks) fill the heap
    between the weights, leaving free holes that later steps touch back in: C1's peak resident
    memory (SmolLM2, quantized weights) was ~35 MB higher. Afterwards the threshold stays where
    glibc's own raising settles (32 MB, trimming at twice that), so steps go on reusing heap
    memory rather than mapping fresh pages.
    """
    mallopt = _glibc_function("mallopt")
    if mallopt is None:  # not glibc: its allocator has a policy of its own
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, 128 << 10)
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        mallopt(_M_TRIM_THRESHOLD, 64 << 20)


def _release_freed_heap() -> None:
    """Give the freed load-time buffers under the mapping threshold (small raw blocks, decoded
    nibbles; see ``_large_host_buffers_mapped``) back to the OS: glibc keeps their heap pages
    resident, ~5 MB for SmolLM2 at C1's peak."""
    malloc_trim = _glibc_function("malloc_trim")
    if malloc_trim is not None:  # elsewhere the memory is reused by later allocations
        malloc_trim(0)


def _glibc_function(name: str) -> Callable[..., int] | None:
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def estimate_model_bytes(model_config: ModelConfig, attn_backend: type[AttentionBackend]) -> int:
    """Bytes the model's parameters take in the run dtype, measured on the meta device (no memory)."""
    model_class = get_model_class(model_config.architectures, model_config.hf_config.model_type)
    with _default_dtype(model_config.dtype), torch.device("meta"):
        model = model_class(model_config.hf_config, attn_backend)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _resolve_load_format(model_config: ModelConfig, load_format: str) -> str:
    if load_format == "auto":
        return "gguf" if _gguf_path(model_config) else "safetensors"
    if load_format not in ("safetensors", "gguf", "dummy"):
        raise ValueError(f"load_format must be 'auto', 'safetensors', 'gguf' or 'dummy', got {load_format!r}")
    return load_format


def _load_weights(
    model: nn.Module, model_config: ModelConfig, load_format: str, device: torch.device
) -> None:
    hf_config = model_config.hf_config
    if load_format == "dummy":
        initialize_dummy_weights(model, getattr(hf_config, "initializer_range", None) or 0.02)
        return
    weights: Iterator[tuple[str, torch.Tensor]]
    if load_format == "gguf":
        path = _gguf_path(model_config)
        if path is None:
            raise ValueError(f"load_format='gguf' needs a .gguf file, got model {model_config.model!r}")
        # Imported here: the gguf package is only needed for GGUF files (the GPU machine may lack it).
        from pagedllm.model_loader.gguf_loader import (
            iterate_gguf_weights,
            keep_embedding_quantized,
            keep_linear_weights_quantized,
        )

        raw_names: frozenset[str] = frozenset()
        quantization = model_config.quantization
        if keeps_gguf_quantized(quantization, True, device, model_config.dtype):
            raw_names = keep_linear_weights_quantized(
                path, model, hf_config, strict=quantization == "gguf"
            ) | keep_embedding_quantized(path, model, hf_config, model_config.dtype)
        weights = iterate_gguf_weights(path, model, hf_config, model_config.dtype, raw_names)
    else:
        weights = _with_decoder_prefix(iterate_safetensors_weights(model_config.model))
    model.load_weights(weights)


# The first tensor names of a bare Llama-style decoder's checkpoint (transformers' *Model).
_BARE_DECODER_NAMES = ("embed_tokens.", "layers.", "norm.")


def _with_decoder_prefix(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A bare decoder's checkpoint (transformers' *Model, as embedding models such as
    Qwen3-Embedding ship theirs) names its tensors without the "model." of the *ForCausalLM
    implementation it runs on: add it (vLLM's pooling models load both layouts)."""
    first = next(weights, None)
    if first is None:
        return
    bare = first[0].startswith(_BARE_DECODER_NAMES)
    for name, tensor in itertools.chain([first], weights):
        yield (f"model.{name}" if bare and not name.startswith("lm_head.") else name), tensor


def _checkpoint_names(model_config: ModelConfig) -> list[str]:
    """The safetensors checkpoint's tensor names as the model loads them (``_with_decoder_prefix``)."""
    return [
        name
        for name, _ in _with_decoder_prefix((name, None) for name in safetensors_names(model_config.model))
    ]


def _gguf_path(model_config: ModelConfig) -> str | None:
    gguf_file = model_config.gguf_file
    if gguf_file is None:
        return model_config.model if model_config.model.endswith(".gguf") else None
    # A bare file name is relative to the model directory, as in from_pretrained(dir, gguf_file=name).
    return gguf_file if os.path.isfile(gguf_file) else os.path.join(model_config.model, gguf_file)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


__all__ = ["get_model"]
