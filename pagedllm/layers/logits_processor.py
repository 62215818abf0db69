"""Hidden states of the rows to sample -> float32 vocabulary logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather
from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding


class LogitsProcessor(nn.Module):
    """Projects onto the (tied or separate) LM head, gathers the vocabulary shards, cuts the padding.

    The caller passes only the rows it samples (each sequence's last token, or every prompt token
    when prompt logprobs are asked for), so a prefill's other positions cost nothing here.
    """

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        # Built after the ranks joined their group: whether each holds a shard of the vocabulary.
        self.gathers = get_tensor_model_parallel_world_size() > 1

    def forward(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_rows, hidden_size] -> [num_rows, vocab_size] float32."""
        # The matmul runs in the model dtype, as the reference does; the sampler wants float32.
        # A head given a linear method (prepacked weights on the CPU) multiplies through it.
        method = getattr(lm_head, "quant_method", None)
        logits = (
            F.linear(hidden_states, lm_head.weight)
            if method is None
            else method.apply(lm_head, hidden_states, None)
        )
        if self.gathers:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[:, : self.vocab_size].float()
