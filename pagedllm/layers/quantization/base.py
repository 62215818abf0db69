"""The seam between a linear layer and how its weight is stored and multiplied (vLLM's
``LinearMethodBase``): the layer owns the parameters and their loaders, a method may replace the
weight's storage before loading, repack it after loading, and computes ``x W^T + b``. An
embedding's method also looks rows up (``EmbeddingMethod``)."""

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


class EmbeddingMethod(LinearMethod):
    """How a ``VocabParallelEmbedding``'s table is kept, looked up and, as a tied LM head,
    multiplied (``apply``; vLLM's ``QuantizeMethodBase.embedding``)."""

    @abstractmethod
    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens], rows of this rank's table -> [num_tokens, embedding_dim] in
        the model dtype."""

    @abstractmethod
    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """This rank's whole table, [num_rows, embedding_dim] dense in the model dtype."""
