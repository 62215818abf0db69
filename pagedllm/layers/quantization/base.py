"""The seam between a linear layer and how its weight is stored and multiplied (vLLM's
``LinearMethodBase``): the layer owns the parameters and their loaders, a method may replace the
weight's storage before loading, repack it after loading, and computes ``x W^T + b``. An
embedding's method also looks rows up (``EmbeddingMethod``)."""

from __future__ import annotations

import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import Any, ClassVar

import torch
from torch import nn

logger = logging.getLogger(__name__)


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


def require(ok: bool, field: str, expected: str, value: Any) -> None:
    """A ValueError naming the ``quantization_config`` field, unless ``ok``."""
    if not ok:
        raise ValueError(f"quantization_config.{field} must be {expected}, got {value!r}")


def matches(name: str, patterns: list[str]) -> bool:
    """Whether a module name is one of ``patterns``: a name, a name's suffix after a dot, or
    ``re:<regex>`` (compressed-tensors' and vLLM's conventions)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith(f".{pattern}"):
            return True
    return False


class QuantizationConfig(ABC):
    """One checkpoint's quantization: parsed from ``quantization_config``, asked per layer."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Parse and validate; a ValueError names the bad field."""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefixes: list[str]) -> LinearMethod | None:
        """The method of a linear layer holding the checkpoint modules ``prefixes`` (q, k and v
        for a merged qkv_proj), or None to keep it dense."""

    def get_moe_method(self, layer: nn.Module, prefix: str, checkpoint_names: Collection[str] = ()) -> Any:
        """The method of a FusedMoE layer holding the checkpoint's experts ``prefix``, or None to keep
        them dense; ``checkpoint_names``: the checkpoint's tensor names, where a format's
        experts may be stored either way (empty: no checkpoint, dummy weights)."""
        raise ValueError(
            f"quant_method {self.name!r} has no support for mixture-of-experts layers ({prefix})"
        )


_NOTIFIED: set[str] = set()


def notify_fallback(what: str, device: torch.device) -> None:
    """Log once per process that ``what`` has no fast kernel on ``device`` (a GPU) and runs
    dequantized to the model dtype: correct, but without the memory and bandwidth savings."""
    message = f"{what} have no fast kernel on {device.type}: they run dequantized to the model dtype"
    if device.type != "cpu" and message not in _NOTIFIED:
        _NOTIFIED.add(message)
        logger.warning(message)


def same_for_all(prefixes: list[str], ignored: list[str], field: str) -> bool:
    """Whether the merged projections are all ignored (True) or none is (False)."""
    flags = {matches(p, ignored) for p in prefixes}
    if len(flags) > 1:
        raise ValueError(
            f"quantization_config.{field} ignores some of the merged projections {prefixes}, not all"
        )
    return flags.pop()
