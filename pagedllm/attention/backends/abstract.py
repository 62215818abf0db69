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

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads

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
