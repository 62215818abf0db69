"""The seam between a linear layer and how its weight is stored and multiplied (vLLM's
``LinearMethodBase``): the layer owns the parameters and their loaders, a method may replace the
weight's storage before loading, repack it after loading, and computes ``x W^T + b``."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class LinearMethod(ABC):
    """How one linear layer's (possibly quantized) weight is kept and applied."""

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded checkpoint storage into the form ``apply`` reads (e.g. pack it)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [num_tokens, input_size] -> [num_tokens, output_size] in x's dtype."""
