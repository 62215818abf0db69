"""Hidden states of the rows to sample -> float32 vocabulary logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from pagedllm.platform import Platform


class LogitsProcessor(CustomOp):
    """Projects onto the (tied or separate) LM head, gathers the vocabulary shards, cuts the padding.

    The caller passes only the rows it samples (each sequence's last token, or every prompt token
    when prompt logprobs are asked for), so a prefill's other positions cost nothing here.

    A head given a linear method (prepacked weights on the CPU, the batch-invariant GEMM)
    multiplies through it. Otherwise the matmul reads the model dtype and the sampler wants
    float32: on one CUDA rank cuBLAS writes float32 straight from its float32 accumulators
    (``out_dtype``), where elsewhere the model-dtype logits are widened by a copy, as the reference
    does. At W6's decode step (256 rows, a vocabulary of 151,936, hidden 2,048, bf16) on an H200,
    timed in a CUDA graph: 244 us against 227 for the bf16 product and 146 more for the copy. The
    logits then skip the rounding to the model dtype (a bf16 logit near 20 is a multiple of 1/8).
    With the vocabulary sharded, the ranks gather model-dtype logits, half the bytes.
    """

    # ``forward`` stays a method calling the chosen path (no ``forward_only_dispatches``):
    # subclasses wrap it (Gemma 2's soft cap, models/gemma.py).

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_rows, hidden_size] -> [num_rows, vocab_size] float32."""
        return self.forward_method(lm_head, hidden_states)

    def dispatch_forward(self, platform: Platform, dtype: torch.dtype) -> Callable[..., Any]:
        # Built after the ranks joined their group: whether each holds a shard of the vocabulary.
        self.sharded = get_tensor_model_parallel_world_size() > 1
        # torch.mm's out_dtype overload: torch 2.8 and later.
        widening_mm = "dtype" in torch.ops.aten.mm.overloads()
        half = dtype in (torch.float16, torch.bfloat16)
        if platform.is_cuda() and half and not self.sharded and widening_mm:
            return self.forward_cuda
        return self.forward_torch

    def forward_torch(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> torch.Tensor:
        method = getattr(lm_head, "quant_method", None)
        logits = (
            F.linear(hidden_states, lm_head.weight)
            if method is None
            else method.apply(lm_head, hidden_states, None)
        )
        if self.sharded:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[:, : self.vocab_size].float()

    def forward_cuda(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> torch.Tensor:
        """One rank, whole vocabulary: no gather, no padding to cut."""
        if getattr(lm_head, "quant_method", None) is not None:
            return self.forward_torch(lm_head, hidden_states)
        return torch.mm(hidden_states, lm_head.weight.t(), out_dtype=torch.float32)
