"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks.

The vocabulary is padded to a multiple of the tensor-parallel size and cut into equal
contiguous ranges, one per rank::

    vocab   [ 0 .......... v/tp | v/tp ........ 2v/tp | ... ]
    rank        0                   1

Rows past the real vocabulary (padding) are zero and never produce a real token: the logits are
cut back to ``vocab_size`` after the gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from pagedllm.layers.quantization.base import EmbeddingMethod, LinearMethod
from pagedllm.layers.utils import CheckpointTensor, copy_weight


class VocabParallelEmbedding(nn.Module):
    """This rank's rows ``[vocab_start, vocab_end)`` of a ``[num_embeddings, embedding_dim]`` table.

    ``quant_method``, when set, owns how the table is kept: an ``EmbeddingMethod`` looks rows up
    (a table kept quantized, set by the model loader before loading; a tied LM head's blocked copy,
    set by the CPU worker after), and LogitsProcessor multiplies through its ``apply``.
    """

    quant_method: EmbeddingMethod | None = None

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        num_rows = -(-num_embeddings // self.tp_size)  # ceil: the padded vocabulary's share
        self.vocab_start = self.tp_rank * num_rows
        self.vocab_end = self.vocab_start + num_rows
        self.weight = nn.Parameter(torch.empty(num_rows, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | str | None = None
    ) -> None:
        """loaded_weight: [num_embeddings, embedding_dim], the whole table."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no packed shards, got shard_id={shard_id!r}")
        if loaded_weight.shape[0] != self.num_embeddings:
            shape = tuple(loaded_weight.shape)
            raise ValueError(f"shape mismatch: vocabulary of {self.num_embeddings} rows, checkpoint {shape}")
        num_rows = max(0, min(self.vocab_end, self.num_embeddings) - self.vocab_start)
        if num_rows:  # a rank past a tiny vocabulary holds padding only
            copy_weight(param.data[:num_rows], loaded_weight.narrow(0, self.vocab_start, num_rows))
        param.data[num_rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] -> [num_tokens, embedding_dim]."""
        if self.tp_size == 1:
            return self._lookup(input_ids)
        # Each rank embeds the ids in its range, zeros elsewhere; the sum over ranks is the lookup.
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        embeddings = self._lookup(local_ids).masked_fill_(~in_range.unsqueeze(-1), 0.0)
        return tensor_model_parallel_all_reduce(embeddings)

    def _lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is None:
            return F.embedding(local_ids, self.weight)
        return self.quant_method.embedding(self, local_ids)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to vocabulary logits (no bias), sharded like the embedding.

    Its weight is read by LogitsProcessor; calling it as an embedding is a bug.
    """

    quant_method: LinearMethod | None = None  # never looked up: a linear method is enough

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not called: LogitsProcessor projects with its weight")
