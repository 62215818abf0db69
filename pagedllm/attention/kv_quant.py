"""The FP8 KV cache (vLLM's ``kv_cache_dtype="fp8"``): K and V stored as float8_e4m3fn, one
float32 scale per tensor per layer.

A layer's cache holds ``saturate(k / k_scale)`` and ``saturate(v / v_scale)`` rounded to e4m3
(nearest, ties to even; ``saturate`` clamps to e4m3's largest finite value, ±448, as vLLM's
``scaled_fp8_conversion`` does, where a plain cast would give NaN). Attention reads
``k_fp8 * k_scale`` and ``v_fp8 * v_scale``. The scales come from the checkpoint where it has
them (``self_attn.k_scale`` / ``v_scale`` / ``kv_scale``, models/kv_scales.py), else 1.0, as in
vLLM: K and V of common models sit well inside ±448, and e4m3 keeps 3 mantissa bits (a relative
error of at most 2^-4 per element) at any magnitude above its normal range's floor, 2^-6.

This module is the torch reference of that arithmetic (the torch backend's cache write and
reads; the tests' oracle for the Triton kernels, which do the same in their cache write and tile
loop) and the one refusal of backends whose kernels read only the model dtype.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backends.abstract import AttentionBackend

FP8_KV_DTYPE = torch.float8_e4m3fn
# The largest finite float8_e4m3fn.
FP8_E4M3_MAX = float(torch.finfo(FP8_KV_DTYPE).max)


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds FP8 K or V (to be scaled on the way in and out)."""
    return cache.dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) as the FP8 cache stores it: ``saturate(x / scale)`` in e4m3. scale: a
    float32 scalar tensor."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 cache contents back to float32 values: ``x * scale``."""
    return x.float() * scale


def store_kv(
    cache: torch.Tensor, index: tuple[torch.Tensor, ...] | torch.Tensor, x: torch.Tensor, scale: torch.Tensor
) -> None:
    """``cache[index] = x``, quantized when the cache is FP8. The FP8 store goes through a byte
    view: advanced-index assignment has no float8 kernel on every device."""
    if is_fp8(cache):
        cache.view(torch.uint8)[index] = quantize_kv(x, scale).view(torch.uint8)
    else:
        cache[index] = x.to(cache.dtype)


def load_kv(
    cache: torch.Tensor, index: tuple[torch.Tensor, ...] | torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``cache[index]``, dequantized to float32 when the cache is FP8 (gathered as bytes, for the
    reason of ``store_kv``); as stored otherwise."""
    if is_fp8(cache):
        return dequantize_kv(cache.view(torch.uint8)[index].view(FP8_KV_DTYPE), scale)
    return cache[index]


def check_kv_cache_dtype(backend: type[AttentionBackend], dtype: torch.dtype) -> None:
    """ValueError naming the backend when it cannot read a cache of ``dtype``."""
    if dtype == FP8_KV_DTYPE and not backend.supports_fp8_kv_cache:
        raise ValueError(
            f"kv_cache_dtype='fp8' is not supported by the {backend.name!r} attention backend (its "
            "kernels read the model dtype); use attention_backend='triton' on CUDA or 'torch'"
        )
