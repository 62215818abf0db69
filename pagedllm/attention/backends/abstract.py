"""What an attention backend provides: its KV cache layout and its forward pass."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from pagedllm.attention.metadata import AttentionMetadata

# One layer's cache: (key_cache, value_cache). Every backend's layout puts the block number
# first, so swapping and copying blocks is the same indexing for all of them.
KVCache = tuple[torch.Tensor, torch.Tensor]


class AttentionBackend(ABC):
    """One attention layer's compute over a paged cache in this backend's layout."""

    name: ClassVar[str]
    # Whether forward() is free of host syncs and data-dependent shapes on decode-only batches,
    # so that a decode step can be captured in a CUDA graph.
    supports_cuda_graphs: ClassVar[bool] = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        *,
        sliding_window: int | None = None,
        alibi_slopes: torch.Tensor | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        """Per-layer attention variants (None: off):

        sliding_window: a query at position p attends to keys at positions > p - sliding_window
            (Hugging Face's ``sliding_window_overlay``: the window holds the query and the
            sliding_window - 1 keys before it).
        alibi_slopes: [num_heads] float32, this rank's heads: score(p, n) += slope * (n - p)
            (Press et al. 2022; softmax is shift-invariant, so BLOOM's slope * n is the same).
        logits_soft_cap: scores become cap * tanh(scores / cap) before ALiBi and masking (Gemma 2).
        """
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")
        if alibi_slopes is not None and tuple(alibi_slopes.shape) != (num_heads,):
            raise ValueError(f"alibi_slopes must have shape [{num_heads}], got {tuple(alibi_slopes.shape)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.sliding_window = sliding_window
        self.alibi_slopes = None if alibi_slopes is None else alibi_slopes.float().contiguous()
        self.logits_soft_cap = logits_soft_cap

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of one layer's (key_cache, value_cache); dimension 0 is the block number."""

    @classmethod
    @abstractmethod
    def check_supported(
        cls, head_size: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Raise ValueError naming what this backend cannot run."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_size]; key, value: [num_tokens, num_kv_heads,
        head_size]. Writes key/value into ``kv_cache`` at ``attn_metadata.slot_mapping``, then
        returns attention over each sequence's context: [num_tokens, num_heads, head_size]."""
