"""Random weights from the config alone (``load_format="dummy"``), for benchmarks without a checkpoint.

The values follow the usual initialization (normal matrices, unit norms, zero biases) so that
activations keep a realistic scale and kernels see realistic numbers. They come from torch's global
generator in module order, so ``torch.manual_seed`` makes them reproducible.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.layernorm import GemmaRMSNorm, RMSNorm


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, initializer_range: float = 0.02) -> None:
    """Fill every parameter in place: norm scales 1, biases 0, integer (quantized) tensors 0, the
    rest N(0, initializer_range²)."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, GemmaRMSNorm):
                param.zero_()  # Gemma's norms scale by 1 + weight
            elif isinstance(module, RMSNorm) or (isinstance(module, nn.LayerNorm) and name == "weight"):
                param.fill_(1.0)
            elif name == "bias":
                param.zero_()
            elif not param.is_floating_point():
                param.zero_()  # packed integer weights, zero points, g_idx: any value in range serves
            elif param.element_size() == 1:  # FP8: drawn in float32, then rounded
                param.copy_(torch.empty(param.shape, device=param.device).normal_(0.0, initializer_range))
            else:
                param.normal_(0.0, initializer_range)
