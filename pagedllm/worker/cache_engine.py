"""The KV cache memory: every layer's blocks on the device, and the CPU swap space."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.attention.backends.abstract import AttentionBackend, KVCache
from pagedllm.worker.input_buffers import to_device


@dataclass(frozen=True)
class KVCacheSpec:
    """The cache's shape, as the model and run dtype fix it (per rank), and the window every layer
    attends through (None: some layer is global), which bounds the blocks a request keeps."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    sliding_window: int | None = None
    # One cache per layer, not K and V: multi-head latent attention caches a latent per token that
    # is both (the layer's value cache is its key cache).
    keys_only: bool = False
    # Recurrent-state slots of a hybrid model (worker/state_cache.py), for the scheduler; 0: none.
    num_state_slots: int = 0

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes over all layers, K and V (vLLM's get_cache_block_size)."""
        element_size = torch.tensor([], dtype=self.dtype).element_size()
        num_caches = 1 if self.keys_only else 2
        return (
            num_caches * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * element_size
        )


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
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _allocate(
        self, backend: type[AttentionBackend], num_blocks: int, device: torch.device, pin_memory: bool
    ) -> list[KVCache]:
        s = self.spec
        key_shape, value_shape = backend.get_kv_cache_shape(
            num_blocks, s.block_size, s.num_kv_heads, s.head_size, s.dtype
        )
        # torch.empty: the OS commits host pages only when a block is first written. Backends
        # never read a slot before writing it (nor past a sequence's length).
        caches = []
        for _ in range(s.num_layers):
            key = torch.empty(key_shape, dtype=s.dtype, device=device, pin_memory=pin_memory)
            value = (
                key
                if s.keys_only
                else torch.empty(value_shape, dtype=s.dtype, device=device, pin_memory=pin_memory)
            )
            caches.append((key, value))
        return caches

    def run_cache_ops(
        self,
        blocks_to_swap_out: list[tuple[int, int]],
        blocks_to_swap_in: list[tuple[int, int]],
        blocks_to_copy: list[tuple[int, int]],
    ) -> None:
        """Do a step's block moves before its forward pass, in this order: swap-outs read blocks
        that this step's copies and prefills may reuse.

        On a GPU they run on a side stream that first waits for the work already queued (the
        previous step wrote these blocks); the compute stream then waits for the moves before the
        forward pass. Swaps are block-sized copies from and to pinned memory, so they are DMA
        transfers that do not hold up the host.
        """
        if not (blocks_to_swap_out or blocks_to_swap_in or blocks_to_copy):
            return
        block_moves = (blocks_to_swap_out, blocks_to_swap_in, blocks_to_copy)
        if self._stream is None:
            self._run(*block_moves)
            return
        compute_stream = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute_stream)
        with torch.cuda.stream(self._stream):
            self._run(*block_moves)
        compute_stream.wait_stream(self._stream)

    def _run(self, blocks_to_swap_out: list, blocks_to_swap_in: list, blocks_to_copy: list) -> None:
        """run_cache_ops' moves, on the current stream."""
        _copy_blocks(self.gpu_cache, self.cpu_cache, blocks_to_swap_out)
        _copy_blocks(self.cpu_cache, self.gpu_cache, blocks_to_swap_in)
        if blocks_to_copy:
            copy_rows([tensor for layer in self.gpu_cache for tensor in layer], blocks_to_copy, self.device)


def copy_rows(tensors: list[torch.Tensor], src_to_dst: list[tuple[int, int]], device: torch.device) -> None:
    """Row ``src`` of every tensor (its first dimension) copied to row ``dst``, for each pair, as
    one gather and one scatter per tensor (so a pair cannot read another's destination): KV
    blocks on copy-on-write, a fork's state rows. As bytes: one copy for every dtype (float8
    lacks index_copy_ kernels)."""
    src = to_device([s for s, _ in src_to_dst], device, torch.long)
    dst = to_device([d for _, d in src_to_dst], device, torch.long)
    for tensor in tensors:
        data = tensor.view(torch.uint8)
        data.index_copy_(0, dst, data.index_select(0, src))


def _copy_blocks(
    src_cache: list[KVCache], dst_cache: list[KVCache], src_to_dst: list[tuple[int, int]]
) -> None:
    """Block-by-block copies between devices. Swaps are rare and the blocks scattered: one copy per
    block and tensor keeps pinned memory on the host side, so each is an asynchronous DMA."""
    for src_layer, dst_layer in zip(src_cache, dst_cache):
        for src_tensor, dst_tensor in zip(src_layer, dst_layer):
            for src, dst in src_to_dst:
                dst_tensor[dst].copy_(src_tensor[src], non_blocking=True)
