"""Dense linear layers on the CPU through oneDNN with weights reordered once, at load.

``F.linear`` hands oneDNN the row-major weight on every call, and oneDNN reorders it into its
blocked layout inside each matmul. Reordering once (``mkldnn._reorder_linear_weight``, what
torch.compile's CPU freezing and vLLM's CPU build do) takes that copy out of every step; the
layer then calls ``mkldnn._linear_pointwise`` on the blocked weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization.base import EmbeddingMethod, LinearMethod
from pagedllm.layers.quantization.gguf import (
    EMBEDDING_BLOCK_BYTES,
    GROUP_SIZE,
    GGUFEmbeddingMethod,
    pack_q4,
    q4_matmul,
    unsupported_reason,
)
from pagedllm.layers.row_buckets import EXACT_ROWS, pad_rows
from pagedllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.platform import platform_for

# The batch size oneDNN picks its blocking for: a decode step of a typical CPU batch.
BATCH_SIZE_HINT = 32
# Rows up to which the int4 product of a Q4 table beats oneDNN's on its bf16 copy. SmolLM2's head
# (49,152 x 576, weights cold, 2 cores): 0.6-0.8 ms for 1 to 4 rows against 1.2-1.3 ms; equal at
# 6 to 8 rows; the int4 kernel's cost grows with the rows, oneDNN's hardly does.
INT4_HEAD_MAX_ROWS = 4


def onednn_available(dtype: torch.dtype) -> bool:
    """Whether dense CPU layers of ``dtype`` run through oneDNN's prepacked linear."""
    return platform_for(torch.device("cpu")).onednn and dtype in (torch.float32, torch.bfloat16)


class OneDNNLinearMethod(LinearMethod):
    """A dense weight in oneDNN's blocked layout (``packed_weight``), replacing ``weight``."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.data, BATCH_SIZE_HINT)
        del layer.weight
        layer.register_buffer("packed_weight", packed, persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        # Past EXACT_ROWS rows (a decode step's, taken as they are) padded to a bucket: oneDNN
        # builds and caches a primitive per input shape.
        x = x.contiguous() if rows <= EXACT_ROWS else pad_rows(x.contiguous())
        out = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, bias, "none", [], "")
        return out if out.shape[0] == rows else out[:rows]


class OneDNNTiedLMHeadMethod(OneDNNLinearMethod, EmbeddingMethod):
    """A tied LM head, which is also the embedding table: the head multiplies a blocked copy of
    the table, and lookups read the table as before, kept beside it: the row-major ``weight``, or
    through ``lookup_method`` the quantized rows it holds (the blocked copy is then made from
    their dequantization).
    """

    def __init__(self, lookup_method: EmbeddingMethod | None = None) -> None:
        self.lookup_method = lookup_method
        self.int4_head = False  # a Q4 table also packed for the int4 kernel, for few rows

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed = torch.ops.mkldnn._reorder_linear_weight(self.dequantize(layer), BATCH_SIZE_HINT)
        layer.register_buffer("packed_weight", packed, persistent=False)
        lookup = self.lookup_method
        if isinstance(lookup, GGUFEmbeddingMethod) and layer.params_dtype == torch.bfloat16:
            num_rows, row_bytes = layer.weight.shape
            embedding_dim = row_bytes // EMBEDDING_BLOCK_BYTES[lookup.tensor_type] * GROUP_SIZE
            if unsupported_reason(lookup.tensor_type, num_rows, embedding_dim) is None:
                qweight, scales_and_zeros = pack_q4(layer.weight.data, lookup.tensor_type)
                layer.register_buffer("qweight", qweight, persistent=False)
                layer.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)
                self.int4_head = True

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # One stream's head reads the 4-bit table: a quarter of the bytes, and the step's cost is
        # the read. Batches take oneDNN, which the int4 kernel's per-row cost loses to.
        if self.int4_head and x.shape[0] <= INT4_HEAD_MAX_ROWS and bias is None:
            return q4_matmul(x, layer.qweight, layer.scales_and_zeros)
        return super().apply(layer, x, bias)

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        if self.lookup_method is None:
            return F.embedding(input_ids, layer.weight)
        return self.lookup_method.embedding(layer, input_ids)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.data if self.lookup_method is None else self.lookup_method.dequantize(layer)


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
        # A head of its own is only multiplied: its row-major weight goes. A tied one is the
        # embedding table too, which lookups go on reading.
        method = (
            OneDNNLinearMethod()
            if isinstance(lm_head, ParallelLMHead)
            else OneDNNTiedLMHeadMethod(lm_head.quant_method)
        )
        lm_head.quant_method = method
        method.process_weights_after_loading(lm_head)
