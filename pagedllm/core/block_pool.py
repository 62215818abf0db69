"""Physical KV blocks and their allocators: a free list plus reference counts, one per location;
on the device, optionally, a prefix cache of computed blocks keyed by their content hash."""

from __future__ import annotations

import enum
from collections import OrderedDict


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

    __slots__ = ("block_hash", "block_number", "block_size", "device", "ref_count")

    def __init__(self, device: Device, block_number: int, block_size: int) -> None:
        self.device = device
        self.block_number = block_number
        self.block_size = block_size
        self.ref_count = 0
        # Set while the block is in the prefix cache: the hash of its tokens and all before them.
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"PhysicalTokenBlock({self.device.name}, #{self.block_number}, ref_count={self.ref_count})"


class BlockAllocator:
    """Hands out the physical blocks of one location and takes them back when unreferenced."""

    def __init__(self, device: Device, block_size: int, num_blocks: int) -> None:
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        # A stack: the most recently freed block is reused first, while it is still warm.
        self._free_blocks: list[PhysicalTokenBlock] = []
        # The blocks from this number on were never handed out: each is made when first needed,
        # after the freed ones and in order, as a stack of them all would hand them out. A cache of
        # a million blocks (the CPU's defaults, for a tiny model) then costs nothing to set up,
        # where making them all took a second.
        self._next_unused = 0

    def allocate(self) -> PhysicalTokenBlock:
        """A free block with ``ref_count == 1``; raises ``NoFreeBlocksError`` when none is left.

        Callers check capacity first (``get_num_free_blocks``), so running out here is a bug.
        """
        if self._free_blocks:
            block = self._free_blocks.pop()
        elif self._next_unused < self.num_blocks:
            block = PhysicalTokenBlock(self.device, self._next_unused, self.block_size)
            self._next_unused += 1
        else:
            raise NoFreeBlocksError(f"out of {self.device.name} blocks ({self.num_blocks} in all)")
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
        return len(self._free_blocks) + self.num_blocks - self._next_unused


class CachingBlockAllocator(BlockAllocator):
    """A device allocator that keeps computed full blocks findable by their content hash.

    A cached block whose last holder frees it is not wiped: it waits in an LRU evictor, still
    findable, until a fresh block is needed and none is free. Free blocks and evictable ones both
    count as free.
    """

    def __init__(self, device: Device, block_size: int, num_blocks: int) -> None:
        super().__init__(device, block_size, num_blocks)
        self._cached: dict[int, PhysicalTokenBlock] = {}
        # Unreferenced cached blocks, least recently freed first.
        self._evictor: OrderedDict[int, PhysicalTokenBlock] = OrderedDict()

    def allocate(self) -> PhysicalTokenBlock:
        # Evict only once every block was handed out and none was freed since.
        if not self._free_blocks and self._next_unused == self.num_blocks and self._evictor:
            _, block = self._evictor.popitem(last=False)
            del self._cached[block.block_hash]
            block.block_hash = None
            self._free_blocks.append(block)
        return super().allocate()

    def peek(self, block_hash: int) -> PhysicalTokenBlock | None:
        return self._cached.get(block_hash)

    def allocate_cached(self, block_hash: int) -> PhysicalTokenBlock | None:
        """Another reference to the cached block with this hash, or None on a miss."""
        block = self._cached.get(block_hash)
        if block is None:
            return None
        if block.ref_count == 0:
            del self._evictor[block.block_number]
        block.ref_count += 1
        return block

    def register(self, block: PhysicalTokenBlock, block_hash: int) -> None:
        """Record a block whose tokens are now computed. A hash already cached (another sequence
        computed the same prefix at the same time) keeps its first block."""
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def free(self, block: PhysicalTokenBlock) -> None:
        if block.ref_count <= 0:
            raise ValueError(f"double free of {block}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is None:
                self._free_blocks.append(block)
            else:
                self._evictor[block.block_number] = block

    def get_num_free_blocks(self) -> int:
        return super().get_num_free_blocks() + len(self._evictor)
