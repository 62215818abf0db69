"""Maps each sequence's logical token blocks to physical KV blocks.

::

    sequence tokens     [t0 t1 t2 t3][t4 t5 t6 t7][t8 t9 .. ..]     logical blocks 0, 1, 2
                              |            |            |
    block_table         [     7     ,      2     ,     11     ]     physical block numbers
    slot of token t9  = block_table[9 // 4] * 4 + 9 % 4 = 11 * 4 + 1 = 45       (block_size 4)

Sequences forked from one another share their blocks (``ref_count`` > 1). A sequence about to
write into a shared block gets its own copy first: ``append_slots`` returns ``(src, dst)`` and the
worker copies the block before the forward pass (copy-on-write). A preempted request with several
sequences is swapped out to the CPU space and back in, block by block; shared blocks move once.

With prefix caching, every full block whose tokens are computed is registered under its prefix
hash (``Sequence.block_hash``). A new sequence starts with the longest run of its full blocks
found there (shared, ``ref_count`` + 1) and computes only the rest; blocks nobody holds stay
cached until a fresh block is needed, the least recently freed (and, among a sequence's, the
deepest) first.
"""

from __future__ import annotations

import enum

from pagedllm.core.block_allocator import BlockAllocator, CachingBlockAllocator, Device, PhysicalTokenBlock
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

BlockTable = list[PhysicalTokenBlock]


class AllocStatus(enum.Enum):
    OK = enum.auto()  # can be allocated now
    LATER = enum.auto()  # not now, once other requests free their blocks
    NEVER = enum.auto()  # larger than the whole cache


class BlockSpaceManager:
    """Block tables of every live sequence, over a device allocator and a CPU swap allocator.

    Args:
        block_size: tokens per block.
        num_gpu_blocks: blocks in the compute device's KV cache.
        num_cpu_blocks: blocks in the CPU swap space.
        watermark: fraction of device blocks kept free at admission, so that running sequences
            can grow a few steps without immediately preempting one another.
        enable_prefix_caching: share the computed blocks of equal prompt prefixes.
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
    ) -> None:
        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        allocator_class = CachingBlockAllocator if enable_prefix_caching else BlockAllocator
        self.gpu_allocator = allocator_class(Device.DEVICE, block_size, num_gpu_blocks)
        self.cpu_allocator = BlockAllocator(Device.CPU, block_size, num_cpu_blocks)
        self.block_tables: dict[int, BlockTable] = {}
        # The same tables as block numbers, kept in step with them: every step sends every running
        # sequence's table to the worker, and rebuilding them would cost a loop over blocks.
        self._block_numbers: dict[int, list[int]] = {}
        # Per sequence, how many of its leading blocks are registered in the prefix cache.
        self._num_registered_blocks: dict[int, int] = {}
        # Prefix-cache lookups and hits, in tokens, since start.
        self.num_cache_queried_tokens = 0
        self.num_cache_hit_tokens = 0

    # --- admission ------------------------------------------------------------------------

    def can_allocate(self, seq_group: SequenceGroup) -> AllocStatus:
        num_required = 0
        for seq in seq_group.get_seqs(SequenceStatus.WAITING):
            # Cached blocks someone holds cost nothing; evictable ones count as free already.
            in_use = [b for b in self._cached_prefix(seq_group, seq, peek=True) if b.ref_count > 0]
            num_required += seq.num_logical_blocks - len(in_use)
        if self.num_total_gpu_blocks - num_required < self.watermark_blocks:
            return AllocStatus.NEVER
        if self.gpu_allocator.get_num_free_blocks() - num_required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq_group: SequenceGroup) -> None:
        """Give every waiting sequence blocks for all of its tokens. With prefix caching, its
        cached leading blocks are shared and its ``num_computed_tokens`` starts after them."""
        for seq in seq_group.get_seqs(SequenceStatus.WAITING):
            assert seq.seq_id not in self.block_tables, f"{seq} already has blocks"
            cached = self._cached_prefix(seq_group, seq, peek=False)
            fresh = [self.gpu_allocator.allocate() for _ in range(seq.num_logical_blocks - len(cached))]
            self._set_table(seq, cached + fresh)
            self._num_registered_blocks[seq.seq_id] = len(cached)
            seq.num_computed_tokens = len(cached) * self.block_size
            if self.enable_prefix_caching:
                self.num_cache_queried_tokens += seq.get_len()
                self.num_cache_hit_tokens += seq.num_computed_tokens

    def _cached_prefix(self, seq_group: SequenceGroup, seq: Sequence, peek: bool) -> list[PhysicalTokenBlock]:
        """The cached blocks the sequence can start with (taking a reference unless peeking).

        At least the last token is always computed, for its logits; requests that want prompt
        logprobs compute every token.
        """
        if not self.enable_prefix_caching or seq_group.sampling_params.prompt_logprobs is not None:
            return []
        allocator = self.gpu_allocator
        assert isinstance(allocator, CachingBlockAllocator)
        blocks = []
        for index in range((seq.get_len() - 1) // self.block_size):
            block_hash = seq.block_hash(index)
            block = allocator.peek(block_hash) if peek else allocator.allocate_cached(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def mark_computed(self, seq: Sequence) -> None:
        """Register the sequence's full blocks whose tokens are now all computed."""
        if not self.enable_prefix_caching:
            return
        allocator = self.gpu_allocator
        assert isinstance(allocator, CachingBlockAllocator)
        block_table = self.block_tables[seq.seq_id]
        num_full = seq.num_computed_tokens // self.block_size
        for index in range(self._num_registered_blocks[seq.seq_id], num_full):
            allocator.register(block_table[index], seq.block_hash(index))
        self._num_registered_blocks[seq.seq_id] = max(num_full, self._num_registered_blocks[seq.seq_id])

    def get_prefix_cache_hit_rate(self) -> float:
        return self.num_cache_hit_tokens / max(self.num_cache_queried_tokens, 1)

    # --- growth ---------------------------------------------------------------------------

    def can_append_slots(self, seq_group: SequenceGroup) -> bool:
        num_required = self._num_blocks_to_grow(seq_group, SequenceStatus.RUNNING)
        return num_required <= self.gpu_allocator.get_num_free_blocks()

    def _num_blocks_to_grow(self, seq_group: SequenceGroup, status: SequenceStatus) -> int:
        """Blocks the group's sequences need for their newest tokens: one for each that starts a
        new logical block or writes into a shared block (copy-on-write)."""
        num_required = 0
        for seq in seq_group.get_seqs(status):
            block_table = self.block_tables[seq.seq_id]
            if len(block_table) < seq.num_logical_blocks or block_table[-1].ref_count > 1:
                num_required += 1
        return num_required

    def append_slots(self, seq: Sequence) -> tuple[int, int] | None:
        """Make room for the sequence's newest token.

        Returns:
            ``(src, dst)`` block numbers when the block the token goes into was shared and has
            been replaced by a private copy that the worker must fill from ``src``; else None.
        """
        block_table = self.block_tables[seq.seq_id]
        if len(block_table) < seq.num_logical_blocks:
            assert len(block_table) == seq.num_logical_blocks - 1, "a sequence grows one block at a time"
            block = self.gpu_allocator.allocate()
            block_table.append(block)
            self._block_numbers[seq.seq_id].append(block.block_number)
            return None
        last_block = block_table[-1]
        assert last_block.device == Device.DEVICE
        if last_block.ref_count == 1:
            return None
        new_block = self.gpu_allocator.allocate()
        block_table[-1] = new_block
        self._block_numbers[seq.seq_id][-1] = new_block.block_number
        self.gpu_allocator.free(last_block)
        return last_block.block_number, new_block.block_number

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """The child shares every block of the parent."""
        src_block_table = self.block_tables[parent_seq.seq_id]
        self._set_table(child_seq, src_block_table.copy())
        self._num_registered_blocks[child_seq.seq_id] = self._num_registered_blocks[parent_seq.seq_id]
        for block in src_block_table:
            block.ref_count += 1

    # --- swapping -------------------------------------------------------------------------

    def _unique_blocks(self, seq_group: SequenceGroup, status: SequenceStatus) -> list[PhysicalTokenBlock]:
        blocks: dict[int, PhysicalTokenBlock] = {}
        for seq in seq_group.get_seqs(status):
            for block in self.block_tables[seq.seq_id]:
                blocks[block.block_number] = block
        return list(blocks.values())

    def can_swap_in(self, seq_group: SequenceGroup) -> AllocStatus:
        blocks = self._unique_blocks(seq_group, SequenceStatus.SWAPPED)
        # Back on the device, the sequences also grow by their next tokens.
        num_required = len(blocks) + self._num_blocks_to_grow(seq_group, SequenceStatus.SWAPPED)
        if self.num_total_gpu_blocks - num_required < self.watermark_blocks:
            return AllocStatus.NEVER
        if self.gpu_allocator.get_num_free_blocks() - num_required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def swap_in(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Move the group's swapped sequences back. Returns CPU -> device block numbers."""
        return self._move(seq_group, SequenceStatus.SWAPPED, self.cpu_allocator, self.gpu_allocator)

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        blocks = self._unique_blocks(seq_group, SequenceStatus.RUNNING)
        return len(blocks) <= self.cpu_allocator.get_num_free_blocks()

    def swap_out(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Move the group's running sequences to the CPU. Returns device -> CPU block numbers."""
        return self._move(seq_group, SequenceStatus.RUNNING, self.gpu_allocator, self.cpu_allocator)

    def _move(
        self, seq_group: SequenceGroup, status: SequenceStatus, src: BlockAllocator, dst: BlockAllocator
    ) -> dict[int, int]:
        mapping: dict[int, PhysicalTokenBlock] = {}
        for seq in seq_group.get_seqs(status):
            new_block_table: BlockTable = []
            for src_block in self.block_tables[seq.seq_id]:
                dst_block = mapping.get(src_block.block_number)
                if dst_block is None:
                    dst_block = mapping[src_block.block_number] = dst.allocate()
                else:
                    dst_block.ref_count += 1
                new_block_table.append(dst_block)
                src.free(src_block)
            self._set_table(seq, new_block_table)
            # Blocks that come back from the CPU are fresh copies, not yet in the prefix cache.
            self._num_registered_blocks[seq.seq_id] = 0
        return {src_number: dst_block.block_number for src_number, dst_block in mapping.items()}

    # --- release --------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references to its blocks (a no-op if it holds none)."""
        block_table = self.block_tables.pop(seq.seq_id, None)
        if block_table is None:
            return
        self._num_registered_blocks.pop(seq.seq_id, None)
        del self._block_numbers[seq.seq_id]
        # Deepest first: with prefix caching, they are evicted first, keeping shared roots longer.
        for block in reversed(block_table):
            allocator = self.gpu_allocator if block.device == Device.DEVICE else self.cpu_allocator
            allocator.free(block)

    def _set_table(self, seq: Sequence, block_table: BlockTable) -> None:
        self.block_tables[seq.seq_id] = block_table
        self._block_numbers[seq.seq_id] = [block.block_number for block in block_table]

    def get_block_table(self, seq: Sequence) -> list[int]:
        """The sequence's physical block numbers. The list itself, not a copy: read it, and only
        until the sequence's blocks next change."""
        return self._block_numbers[seq.seq_id]

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu_allocator.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_allocator.get_num_free_blocks()
