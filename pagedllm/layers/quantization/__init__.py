"""Quantized weights: how a linear layer's weight is stored and multiplied (see base.LinearMethod).

``quantization`` (an engine argument) says when GGUF's quantized linear weights (and embedding
tables whose rows a lookup can dequantize: layers/quantization/gguf.py) stay quantized:
'gguf' always (an error where they cannot), 'none' never (dequantized at load, the oracle), and
'auto' on the CPU in bfloat16 (the int4 kernel's activation dtype; float32 runs are the ones
compared with HF's dequantized reference).
"""

from __future__ import annotations

import torch

from pagedllm.layers.quantization.base import LinearMethod


def keeps_gguf_quantized(quantization: str, is_gguf: bool, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model's quantized GGUF linear weights are kept quantized (see the module doc)."""
    if quantization == "none" or not is_gguf:
        return False
    if device.type != "cpu":
        if quantization == "gguf":
            raise ValueError(
                f"quantization='gguf' runs on the CPU only (torch's int4 CPU kernel), got {str(device)!r}"
            )
        return False
    return quantization == "gguf" or dtype == torch.bfloat16


__all__ = ["LinearMethod", "keeps_gguf_quantized"]
