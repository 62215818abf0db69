"""Dense linear layers and the LM head through the batch-invariant GEMM, and the experts of MoE
layers through their invariant form (``batch_invariant=True`` on CUDA; docs/determinism.md).

A ``LinearMethod`` like any other (the seam quantization and oneDNN's prepacking use): the worker
attaches it to every dense layer after loading, choosing each layer's K split and tiles once, from
its shape and the GPU (``LayerGemm.for_layer``); a step chooses only between the layer's narrow
and wide output tiles by its number of rows, which leaves the sums as they are. The
weight stays as loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.triton.batch_invariant_matmul import LayerGemm
from pagedllm.layers.fused_moe.layer import FusedMoE
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization.base import EmbeddingMethod, LinearMethod
from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding


class BatchInvariantLinearMethod(LinearMethod):
    """``x W^T + b`` with K summed in the layer's fixed ranges of K tiles, whatever the number of
    rows."""

    def __init__(self, gemm: LayerGemm) -> None:
        self.gemm = gemm

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass  # the kernel reads nn.Linear's [N, K] weight as it is

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return self.gemm(rows, layer.weight, bias).view(*x.shape[:-1], -1)


class BatchInvariantLMHeadMethod(BatchInvariantLinearMethod, EmbeddingMethod):
    """The LM head's product through the kernel; a tied head is also the embedding table, which
    lookups go on reading as before."""

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, layer.weight)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.data


def use_batch_invariant_gemms(model: nn.Module, device: torch.device) -> None:
    """Every dense linear layer and the LM head of ``model`` (loaded, on ``device``) through the
    batch-invariant GEMM, every FusedMoE layer's experts through theirs. ValueError naming a layer
    that has no invariant path."""
    for name, module in model.named_modules():
        if not getattr(module, "has_batch_invariant_form", True):
            raise ValueError(
                f"batch_invariant=True: {name} ({type(module).__name__}) has no batch-invariant form"
            )
        if isinstance(module, FusedMoE):
            if module.quant_method is not None:
                raise ValueError(
                    f"batch_invariant=True: the experts of {name} are quantized "
                    f"({type(module.quant_method).__name__}), which has no batch-invariant GEMM"
                )
            module.use_batch_invariant()
        if isinstance(module, LinearBase | VocabParallelEmbedding) and module.quant_method is not None:
            raise ValueError(
                f"batch_invariant=True: {name} is quantized ({type(module.quant_method).__name__}), "
                "which has no batch-invariant GEMM"
            )
        if isinstance(module, LinearBase):
            module.quant_method = _invariant_method(BatchInvariantLinearMethod, module.weight, device)
    lm_head = getattr(model, "lm_head", None)
    if not isinstance(lm_head, VocabParallelEmbedding):  # LogitsProcessor would take F.linear
        raise ValueError(f"batch_invariant=True: {type(model).__name__} has no lm_head to route")
    lm_head.quant_method = _invariant_method(BatchInvariantLMHeadMethod, lm_head.weight, device)


def _invariant_method(
    method: type[BatchInvariantLinearMethod], weight: torch.Tensor, device: torch.device
) -> BatchInvariantLinearMethod:
    """The layer's method, its K split and tiles chosen once from its shape and the GPU."""
    n, k = weight.shape
    return method(LayerGemm.for_layer(n, k, device, weight.element_size()))
