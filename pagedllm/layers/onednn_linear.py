"""Dense linear layers on the CPU through oneDNN with weights reordered once, at load.

``F.linear`` hands oneDNN the row-major weight on every call, and oneDNN reorders it into its
blocked layout inside each matmul. Reordering once (``mkldnn._reorder_linear_weight``, what
torch.compile's CPU freezing and vLLM's CPU build do) takes that copy out of every step; the
layer then calls ``mkldnn._linear_pointwise`` on the blocked weight.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization.base import LinearMethod
from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding

# The batch size oneDNN picks its blocking for: a decode step of a typical CPU batch.
BATCH_SIZE_HINT = 32


def onednn_available(dtype: torch.dtype) -> bool:
    return torch.backends.mkldnn.is_available() and dtype in (torch.float32, torch.bfloat16)


class OneDNNLinearMethod(LinearMethod):
    """A dense weight in oneDNN's blocked layout (``packed_weight``), replacing ``weight``.

    keep_weight: keep the row-major ``weight`` too, for a tied LM head that is also the embedding.
    """

    def __init__(self, keep_weight: bool = False) -> None:
        self.keep_weight = keep_weight

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.data, BATCH_SIZE_HINT)
        if not self.keep_weight:
            del layer.weight
        layer.register_buffer("packed_weight", packed, persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), layer.packed_weight, bias, "none", [], "")


def prepack_dense_weights(model: nn.Module) -> None:
    """oneDNN-blocked weights for the dense linear layers and the LM head (measured 1.5-2.5x
    faster per decode step than F.linear on the CPU: benchmarks/RESULTS.md). Layers with a
    quantized method keep it. Done by the worker after loading, so a loaded model (as tests and
    tools see it) keeps its plain weights."""
    for module in model.modules():
        if isinstance(module, LinearBase) and module.quant_method is None:
            module.quant_method = OneDNNLinearMethod()
            module.quant_method.process_weights_after_loading(module)
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, VocabParallelEmbedding):
        # The row-major weight stays: a tied head is also the embedding table, which lookups read.
        lm_head.quant_method = OneDNNLinearMethod(keep_weight=True)
        lm_head.quant_method.process_weights_after_loading(lm_head)
