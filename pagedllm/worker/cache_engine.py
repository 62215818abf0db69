"""The KV cache memory: every layer's blocks on the device, and the CPU swap space."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.attention.backends.abstract import AttentionBackend, KVCache


@dataclass(frozen=True)
class KVCacheSpec:
    """The cache's shape, as the model and run dtype fix it (per rank)."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes over all layers, K and V (seed 000's get_cache_block_size)."""
        element_size = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * element_size


class CacheEngine:
    """Allocates the caches and moves blocks: device <-> CPU swaps and device copies.

    Every backend's layout puts the block number in dimension 0 of both K and V, so block
    moves are plain indexing, whatever the layout behind it.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        backend: type[AttentionBackend],
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        device: torch.device,
    ) -> None:
        self.spec = spec
        self.device = device
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.gpu_cache = self._allocate(backend, num_gpu_blocks, device, pin_memory=False)
        # Pinned so that swaps are true asynchronous DMA copies on a GPU.
        self.cpu_cache = self._allocate(
            backend, num_cpu_blocks, torch.device("cpu"), pin_memory=device.type == "cuda"
        )

    def _allocate(
        self, backend: type[AttentionBackend], num_blocks: int, device: torch.device, pin_memory: bool
    ) -> list[KVCache]:
        s = self.spec
        key_shape, value_shape = backend.get_kv_cache_shape(
            num_blocks, s.block_size, s.num_kv_heads, s.head_size, s.dtype
        )
        # torch.empty: the OS commits host pages only when a block is first written. Backends
        # never read a slot before writing it (nor past a sequence's length).
        return [
            (
                torch.empty(key_shape, dtype=s.dtype, device=device, pin_memory=pin_memory),
                torch.empty(value_shape, dtype=s.dtype, device=device, pin_memory=pin_memory),
            )
            for _ in range(s.num_layers)
        ]

    def swap_in(self, src_to_dst: list[tuple[int, int]]) -> None:
        """CPU blocks -> device blocks."""
        self._move(self.cpu_cache, self.gpu_cache, src_to_dst)

    def swap_out(self, src_to_dst: list[tuple[int, int]]) -> None:
        """Device blocks -> CPU blocks."""
        self._move(self.gpu_cache, self.cpu_cache, src_to_dst)

    def copy(self, src_to_dst: list[tuple[int, int]]) -> None:
        """Device block -> device block, for copy-on-write."""
        self._move(self.gpu_cache, self.gpu_cache, src_to_dst)

    @staticmethod
    def _move(src_cache: list[KVCache], dst_cache: list[KVCache], src_to_dst: list[tuple[int, int]]) -> None:
        if not src_to_dst:
            return
        src_device, dst_device = src_cache[0][0].device, dst_cache[0][0].device
        src = torch.tensor([s for s, _ in src_to_dst], dtype=torch.long, device=src_device)
        dst = torch.tensor([d for _, d in src_to_dst], dtype=torch.long, device=dst_device)
        for src_layer, dst_layer in zip(src_cache, dst_cache):
            for src_tensor, dst_tensor in zip(src_layer, dst_layer):
                dst_tensor.index_copy_(
                    0, dst, src_tensor.index_select(0, src).to(dst_device, non_blocking=True)
                )
