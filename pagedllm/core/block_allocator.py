"""Physical KV blocks and their allocator: a free list plus reference counts, one per location."""

from __future__ import annotations

import enum


class Device(enum.Enum):
    """Where a physical block lives: the compute device's KV cache, or the CPU swap space."""

    DEVICE = enum.auto()
    CPU = enum.auto()


class NoFreeBlocksError(RuntimeError):
    pass


class PhysicalTokenBlock:
    """One block of ``block_size`` token slots in a KV cache.

    ``ref_count`` is the number of block tables (of live sequences) that hold it; a block with
    ``ref_count > 1`` is shared and must be copied before it is written (copy-on-write).
    """

    __slots__ = ("block_number", "block_size", "device", "ref_count")

    def __init__(self, device: Device, block_number: int, block_size: int) -> None:
        self.device = device
        self.block_number = block_number
        self.block_size = block_size
        self.ref_count = 0

    def __repr__(self) -> str:
        return f"PhysicalTokenBlock({self.device.name}, #{self.block_number}, ref_count={self.ref_count})"


class BlockAllocator:
    """Hands out the physical blocks of one location and takes them back when unreferenced."""

    def __init__(self, device: Device, block_size: int, num_blocks: int) -> None:
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        # A stack: the most recently freed block is reused first, while it is still warm.
        self._free_blocks = [PhysicalTokenBlock(device, i, block_size) for i in reversed(range(num_blocks))]

    def allocate(self) -> PhysicalTokenBlock:
        """A free block with ``ref_count == 1``; raises ``NoFreeBlocksError`` when none is left.

        Callers check capacity first (``get_num_free_blocks``), so running out here is a bug.
        """
        if not self._free_blocks:
            raise NoFreeBlocksError(f"out of {self.device.name} blocks ({self.num_blocks} in all)")
        block = self._free_blocks.pop()
        block.ref_count = 1
        return block

    def free(self, block: PhysicalTokenBlock) -> None:
        """Drop one reference; the block returns to the free list when none is left."""
        if block.ref_count <= 0:
            raise ValueError(f"double free of {block}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free_blocks.append(block)

    def get_num_free_blocks(self) -> int:
        return len(self._free_blocks)
