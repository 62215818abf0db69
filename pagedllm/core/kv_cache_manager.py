"""KVCacheManager: which physical KV blocks each request's tokens live in.
::
    request tokens      [t0 t1 t2 t3][t4 t5 t6 t7][t8 t9 .. ..]     logical blocks 0, 1, 2
                              |            |            |
    block table         [     7     ,      2     ,     11     ]     physical block numbers
    slot of token t9  = block_table[9 // 4] * 4 + 9 % 4 = 11 * 4 + 1 = 45       (block_size 4)

Siblings forked from one another share their blocks (``ref_count`` > 1). A request about to
write into a shared block gets its own copy first: ``append_slots`` returns ``(src, dst)`` and
the worker copies the block before the forward pass (copy-on-write). A preempted request with
live siblings is swapped out to the CPU space and back in with them, block by block; shared
blocks move once.

With prefix caching, every full block whose tokens are computed, by a step whose outputs have
been applied, is registered under its prefix hash (``Request.block_hashes``): a step that failed
and was dropped leaves nothing shared behind. A new request starts with the longest run of its full blocks
found there (shared, ``ref_count`` + 1) and computes only the rest; blocks nobody holds stay
cached until a fresh block is needed, the least recently freed (and, among a request's, the
deepest) first.

With a sliding window on every layer (``sliding_window``), a request needs the KV of its last
``sliding_window`` tokens only, plus, with attention sinks (StreamingLLM, Xiao et al. 2023), its
first ``num_sink_tokens``: before each step ``slide_window`` frees the blocks that fell wholly
out of the window and drops them from the table, so a decoding request holds at most
``ceil(num_sink_tokens / block_size) + ceil(sliding_window / block_size) + 1`` blocks however long
it runs. The table then reads [sink blocks][window blocks]::

    logical blocks      [s0][ 1 ][ 2 ][ 3 ][ 4 ][ 5 ]       num_sink_tokens 4, block_size 4
    block table         [s0]           [ 3 ][ 4 ][ 5 ]      2 blocks dropped: 8 tokens

and the attention kernels see a shorter context in *cache positions*: a token at position p >= the
dropped blocks' end sits at ``p - num_dropped_tokens``. Distances between the window's tokens, and
so the window's mask, are unchanged; blocks are dropped only once every query of the step is at
least ``sliding_window`` past the sink blocks' last slot, so the sink blocks' tail (tokens past
``num_sink_tokens``) always falls outside the window.

Hybrid models (linear-attention layers beside attention ones) also own a recurrent-state slot
per request (``num_state_slots``, core/state_cache.py): taken at admission with the blocks, held
while swapped, given back with them; a fork takes its own, filled with its parent's state before
the next step (``take_state_copies``). Prefix reuse is off for them: a cached block carries the
attention layers' K/V but not the state after its tokens.

The scheduler asks questions (``can_allocate``, ``try_append_slot``, ``can_swap_in``) and gives
orders; it never reads the tables. Workers hold a copy of every running request's table: the
manager records which entries changed since they were last sent (``take_block_table_diff``).
"""

from __future__ import annotations

import enum
import logging

from pagedllm.core.block_pool import BlockAllocator, CachingBlockAllocator, Device, PhysicalTokenBlock
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.state_cache import StateSlotPool
from pagedllm.step_io import SchedulerOutput

BlockTable = list[PhysicalTokenBlock]

logger = logging.getLogger(__name__)


class AllocStatus(enum.Enum):
    OK = enum.auto()  # can be allocated now
    LATER = enum.auto()  # not now, once other requests free their blocks
    NEVER = enum.auto()  # larger than the whole cache


class KVCacheManager:
    """Block tables of every live request, over a device allocator and a CPU swap allocator.

    Args:
        block_size: tokens per block.
        num_gpu_blocks: blocks in the compute device's KV cache.
        num_cpu_blocks: blocks in the CPU swap space.
        watermark: fraction of device blocks kept free at admission, so that running requests
            can grow a few steps without immediately preempting one another.
        enable_prefix_caching: share the computed blocks of equal prompt prefixes.
        sliding_window: the window when every layer attends through one (the largest, if they
            differ), so that blocks behind it can be freed; None keeps every block.
        num_sink_tokens: leading tokens kept whatever the window (attention sinks).
        max_blocks_per_request: the workers' block table width; with sinks a request may outgrow
            it in tokens, and is then never given all of its blocks at once (recomputed).
        num_state_slots: recurrent-state slots of a hybrid model's linear-attention layers (0:
            none); a request is admitted only with a free one.
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        sliding_window: int | None = None,
        num_sink_tokens: int = 0,
        max_blocks_per_request: int | None = None,
        num_state_slots: int = 0,
    ) -> None:
        if num_sink_tokens and sliding_window is None:
            raise ValueError("num_sink_tokens needs a sliding_window")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_sink_blocks = -(-num_sink_tokens // block_size)
        self.max_blocks_per_request = max_blocks_per_request
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.state_pool = StateSlotPool(num_state_slots) if num_state_slots else None
        if enable_prefix_caching and self.state_pool is not None:
            logger.info(
                "prefix caching disabled: the model's linear-attention layers keep a recurrent state "
                "that cached KV blocks do not hold"
            )
            enable_prefix_caching = False
        self.enable_prefix_caching = enable_prefix_caching
        allocator_class = CachingBlockAllocator if enable_prefix_caching else BlockAllocator
        self.gpu_allocator = allocator_class(Device.DEVICE, block_size, num_gpu_blocks)
        self.cpu_allocator = BlockAllocator(Device.CPU, block_size, num_cpu_blocks)
        self._tables: dict[int, BlockTable] = {}
        # The same tables as block numbers, kept in step with them (read every step).
        self._block_ids: dict[int, list[int]] = {}
        # Per request, the first table entry the workers have not seen (None: they are current).
        self._first_unsent: dict[int, int | None] = {}
        # Per request, how many of its leading blocks are registered in the prefix cache.
        self._num_cached_blocks: dict[int, int] = {}
        # Per request, window blocks freed (see slide_window): logical block b >= num_sink_blocks
        # is table entry b - num_dropped.
        self._num_dropped: dict[int, int] = {}
        # Copies-on-write given this step, not yet done by the workers: req_id -> (table index,
        # the shared block, the private copy), so that preempting the request can take one back.
        self._copies: dict[int, tuple[int, PhysicalTokenBlock, PhysicalTokenBlock]] = {}
        # Forks' state rows to copy from their parents, not yet handed to a step: (parent's slot,
        # child's slot).
        self._state_copies: list[tuple[int, int]] = []
        # Prefix-cache lookups and hits, in tokens, since start.
        self.num_cache_queried_tokens = 0
        self.num_cache_hit_tokens = 0

    # --- admission ------------------------------------------------------------------------

    def can_allocate(self, request: Request) -> AllocStatus:
        """Whether blocks for all of a waiting request's tokens can be given now."""
        # Cached blocks someone holds cost nothing; evictable ones count as free already.
        in_use = [b for b in self._cached_prefix(request, peek=True) if b.ref_count > 0]
        num_required = self._num_blocks_for(request.num_tokens) - len(in_use)
        if self.num_total_gpu_blocks - num_required < self.watermark_blocks:
            return AllocStatus.NEVER
        if self.max_blocks_per_request is not None and num_required > self.max_blocks_per_request:
            return AllocStatus.NEVER
        if self.state_pool is not None and not self.state_pool.can_allocate():
            return AllocStatus.LATER
        if self.gpu_allocator.get_num_free_blocks() - num_required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, request: Request) -> None:
        """Give a waiting request blocks for all of its tokens. With prefix caching, its cached
        leading blocks are shared and its ``num_computed_tokens`` starts after them."""
        assert request.req_id not in self._tables, f"{request} already has blocks"
        cached = self._cached_prefix(request, peek=False)
        num_fresh = self._num_blocks_for(request.num_tokens) - len(cached)
        self._set_table(request.req_id, cached + [self.gpu_allocator.allocate() for _ in range(num_fresh)])
        self._num_cached_blocks[request.req_id] = len(cached)
        self._num_dropped[request.req_id] = 0
        if self.state_pool is not None:
            self.state_pool.allocate(request.req_id)
        request.num_computed_tokens = len(cached) * self.block_size
        if self.enable_prefix_caching:
            self.num_cache_queried_tokens += request.num_tokens
            self.num_cache_hit_tokens += request.num_computed_tokens

    def _cached_prefix(self, request: Request, peek: bool) -> list[PhysicalTokenBlock]:
        """The cached blocks the request can start with (taking a reference unless peeking).

        At least the last token is always computed, for its logits; requests that want prompt
        logprobs compute every token.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        allocator = self.gpu_allocator
        assert isinstance(allocator, CachingBlockAllocator)
        hashes = request.update_block_hashes()
        blocks = []
        for index in range((request.num_tokens - 1) // self.block_size):
            block = allocator.peek(hashes[index]) if peek else allocator.allocate_cached(hashes[index])
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks among its first ``num_computed_tokens`` tokens
        (computed by steps already applied) that are known."""
        if not self.enable_prefix_caching or request.req_id not in self._tables:
            return
        allocator = self.gpu_allocator
        assert isinstance(allocator, CachingBlockAllocator)
        table = self._tables[request.req_id]
        if table and table[0].device != Device.DEVICE:
            return
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        first = self._num_cached_blocks[request.req_id]
        if num_full <= first:
            return
        hashes = request.update_block_hashes()
        for index in range(first, num_full):
            position = self._table_index(request.req_id, index)
            if position is not None:  # dropped before its step was applied: nothing to share
                allocator.register(table[position], hashes[index])
        self._num_cached_blocks[request.req_id] = num_full

    def cache_computed_blocks(self, scheduler_output: SchedulerOutput, requests: dict[int, Request]) -> None:
        """Register the blocks a step filled, once its samples arrive. Only then, and only up to
        what the step computed: with asynchronous scheduling the next step is already launched,
        and were it dropped its blocks must not be found by anyone. (The step's own samples add
        nothing: the positions it computed held tokens known before it.)"""
        if not self.enable_prefix_caching:
            return
        computed = {data.req_id: data.num_computed_tokens for data in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                self.cache_blocks(request, computed[req_id] + num_tokens)

    def get_prefix_cache_hit_rate(self) -> float:
        return self.num_cache_hit_tokens / max(self.num_cache_queried_tokens, 1)

    # --- growth ---------------------------------------------------------------------------

    def num_blocks_to_grow(self, request: Request, num_new_tokens: int) -> int:
        """Blocks the request needs to compute ``num_new_tokens`` more tokens: new logical blocks,
        plus one when its first new token goes into a shared block (copy-on-write)."""
        num_required = max(
            self._num_blocks_for(request.num_computed_tokens + num_new_tokens) - self._num_logical(request), 0
        )
        index = self._write_index(request)
        table = self._tables[request.req_id]
        if index < len(table) and table[index].ref_count > 1:
            num_required += 1
        return num_required

    def try_append_slot(self, request: Request, num_new_tokens: int = 1) -> tuple[int, int] | bool:
        """Room for a decoding request's next token (and, with speculative decoding, the drafts
        after it: ``num_new_tokens`` in all) if the cache has it: ``True`` (or the copy-on-write
        ``(src, dst)`` pair the worker must do first) once done, ``False`` when there are not
        enough free blocks (nothing is changed then).

        The common case, tokens that land in a private block the request already holds, is
        answered without touching the allocator. (Only the first block written can be shared: a
        fork shares its parent's table, which ends at the block of the parent's newest token.)
        """
        req_id = request.req_id
        table = self._tables[req_id]
        dropped = self._num_dropped[req_id]
        first_token = request.num_computed_tokens
        block_size = self.block_size
        last = (first_token + num_new_tokens - 1) // block_size - dropped
        if last < len(table) and table[first_token // block_size - dropped].ref_count == 1:
            return True
        if self.num_blocks_to_grow(request, num_new_tokens) > self.gpu_allocator.get_num_free_blocks():
            return False
        return self.append_slots(request, num_new_tokens) or True

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past its first ``num_tokens`` tokens: those that held only
        drafts the verification rejected (their slots are written again by later steps). The
        workers keep the stale entries, which nothing reads until an append resends them."""
        req_id = request.req_id
        table = self._tables[req_id]
        num_kept = self._num_blocks_for(num_tokens) - self._num_dropped[req_id]
        if num_kept >= len(table):
            return
        allocator = self.gpu_allocator if table[-1].device == Device.DEVICE else self.cpu_allocator
        for block in reversed(table[num_kept:]):
            allocator.free(block)
        del table[num_kept:], self._block_ids[req_id][num_kept:]

    def append_slots(self, request: Request, num_new_tokens: int = 1) -> tuple[int, int] | None:
        """Make room for the request's next ``num_new_tokens`` tokens.

        Returns:
            ``(src, dst)`` block numbers when the block the first new token goes into was shared
            and has been replaced by a private copy that the worker must fill from ``src``.
        """
        req_id = request.req_id
        table = self._tables[req_id]
        block_ids = self._block_ids[req_id]
        cow = None
        index = self._write_index(request)
        if index < len(table) and table[index].ref_count > 1:
            shared = table[index]
            table[index] = self.gpu_allocator.allocate()
            block_ids[index] = table[index].block_number
            self.gpu_allocator.free(shared)
            self._mark_unsent(req_id, index)
            cow = (shared.block_number, table[index].block_number)
            self._copies[req_id] = (index, shared, table[index])
        num_logical = self._num_logical(request)
        for _ in range(self._num_blocks_for(request.num_computed_tokens + num_new_tokens) - num_logical):
            self._mark_unsent(req_id, len(table))
            table.append(self.gpu_allocator.allocate())
            block_ids.append(table[-1].block_number)
        return cow

    def start_step(self) -> None:
        """A new step is being scheduled: the last one's copies are the workers' now."""
        self._copies.clear()

    def undo_copy_on_write(self, request: Request) -> tuple[int, int] | None:
        """Take back the copy-on-write given to the request this step (it is being preempted,
        and a swap out would move the copy before the workers make it): the request shares the
        block again. Returns the ``(src, dst)`` pair to drop from the step, or None."""
        entry = self._copies.pop(request.req_id, None)
        if entry is None:
            return None
        index, shared, private = entry
        # Only siblings share a block a request writes into, and they are preempted together,
        # each taking its copy back before any frees: the shared block is still held.
        assert shared.ref_count > 0, f"{shared} was freed before its copy-on-write was taken back"
        req_id = request.req_id
        self._tables[req_id][index] = shared
        self._block_ids[req_id][index] = shared.block_number
        shared.ref_count += 1
        self.gpu_allocator.free(private)
        self._mark_unsent(req_id, index)
        return shared.block_number, private.block_number

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent. With recurrent state it takes a slot of its
        own, which the workers fill with a copy of the parent's before the next step's forward
        pass (``take_state_copies``): forks happen between steps, once the step in flight has
        been waited for, so the copy is the state after every token both share, and neither has
        computed another."""
        if self.state_pool is not None:
            if not self.state_pool.can_allocate():
                # The scheduler seats a group's forks when it admits the group, and the pool has
                # a slot per seat (max_num_seqs): running out is a bug, not a full cache.
                raise RuntimeError(f"no state slot left to fork request {parent.req_id} into")
            parent_slot = self.state_pool.slot_of(parent.req_id)
            self._state_copies.append((parent_slot, self.state_pool.allocate(child.req_id)))
        table = self._tables[parent.req_id]
        self._set_table(child.req_id, table.copy())
        self._num_cached_blocks[child.req_id] = self._num_cached_blocks[parent.req_id]
        self._num_dropped[child.req_id] = self._num_dropped[parent.req_id]
        for block in table:
            block.ref_count += 1

    def slide_window(self, request: Request) -> bool:
        """Free the request's window blocks that no query from its next token on can see (every
        slot before ``num_computed_tokens - sliding_window + 1``); True when some were freed.

        Called before each step's tokens are scheduled. A step still in flight may read a block
        freed here; the block's next owner writes it in a later step, after that read on the
        device's stream.
        """
        if self.sliding_window is None:
            return False
        req_id = request.req_id
        table = self._tables[req_id]
        first_visible = request.num_computed_tokens - self.sliding_window + 1
        first_kept = self.num_sink_blocks + self._num_dropped[req_id]
        num_free = min(first_visible // self.block_size - first_kept, len(table) - self.num_sink_blocks)
        if num_free <= 0:
            return False
        start = self.num_sink_blocks
        allocator = self.gpu_allocator if table[start].device == Device.DEVICE else self.cpu_allocator
        for block in reversed(table[start : start + num_free]):
            allocator.free(block)
        del table[start : start + num_free], self._block_ids[req_id][start : start + num_free]
        self._num_dropped[req_id] += num_free
        self._mark_unsent(req_id, start)
        return True

    def get_num_dropped_tokens(self, request: Request) -> int:
        """Tokens of the request's dropped blocks: a token at position p past them sits at cache
        position p - this (0 without a sliding window)."""
        return self._num_dropped[request.req_id] * self.block_size

    # --- swapping -------------------------------------------------------------------------

    def _unique_blocks(self, requests: list[Request]) -> list[PhysicalTokenBlock]:
        blocks: dict[int, PhysicalTokenBlock] = {}
        for request in requests:
            for block in self._tables[request.req_id]:
                blocks[block.block_number] = block
        return list(blocks.values())

    def can_swap_in(self, requests: list[Request]) -> AllocStatus:
        # Back on the device, the requests also grow by their next tokens.
        num_required = len(self._unique_blocks(requests)) + sum(
            self._num_blocks_for(r.num_tokens) - self._num_logical(r) for r in requests
        )
        num_required += len(requests)  # the first write of each may copy a shared block
        if self.num_total_gpu_blocks - num_required < self.watermark_blocks:
            return AllocStatus.NEVER
        if self.gpu_allocator.get_num_free_blocks() - num_required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def swap_in(self, requests: list[Request]) -> dict[int, int]:
        """Move swapped requests back. Returns CPU -> device block numbers."""
        return self._move(requests, self.cpu_allocator, self.gpu_allocator)

    def can_swap_out(self, requests: list[Request]) -> bool:
        return len(self._unique_blocks(requests)) <= self.cpu_allocator.get_num_free_blocks()

    def swap_out(self, requests: list[Request]) -> dict[int, int]:
        """Move running requests to the CPU. Returns device -> CPU block numbers."""
        return self._move(requests, self.gpu_allocator, self.cpu_allocator)

    def _move(self, requests: list[Request], src: BlockAllocator, dst: BlockAllocator) -> dict[int, int]:
        mapping: dict[int, PhysicalTokenBlock] = {}
        for request in requests:
            new_table: BlockTable = []
            for src_block in self._tables[request.req_id]:
                dst_block = mapping.get(src_block.block_number)
                if dst_block is None:
                    dst_block = mapping[src_block.block_number] = dst.allocate()
                else:
                    dst_block.ref_count += 1
                new_table.append(dst_block)
                src.free(src_block)
            self._set_table(request.req_id, new_table)
            # Blocks that come back from the CPU are fresh copies, not yet in the prefix cache.
            self._num_cached_blocks[request.req_id] = 0
        return {src_number: dst_block.block_number for src_number, dst_block in mapping.items()}

    # --- release --------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Drop the request's references to its blocks and its state slot (a no-op if it holds
        none)."""
        if self.state_pool is not None:
            self.state_pool.free(request.req_id)
        table = self._tables.pop(request.req_id, None)
        if table is None:
            return
        del self._num_cached_blocks[request.req_id], self._block_ids[request.req_id]
        del self._first_unsent[request.req_id], self._num_dropped[request.req_id]
        self._copies.pop(request.req_id, None)
        # Deepest first: with prefix caching, they are evicted first, keeping shared roots longer.
        for block in reversed(table):
            allocator = self.gpu_allocator if block.device == Device.DEVICE else self.cpu_allocator
            allocator.free(block)

    def holders(self, block_numbers: set[int], device: Device) -> list[int]:
        """Ids of the requests holding one of these blocks of ``device``."""
        return [
            req_id
            for req_id, table in self._tables.items()
            if any(block.device == device and block.block_number in block_numbers for block in table)
        ]

    # --- what the workers see -------------------------------------------------------------

    def get_block_ids(self, request: Request) -> list[int]:
        """The request's physical block numbers. The list itself, not a copy: read it, and only
        until the request's blocks next change."""
        return self._block_ids[request.req_id]

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The forks' state copies since the last call, for the next step to make first, as one
        gather and one scatter: a fork of a fork copies from the first parent (a copy cannot read
        another's destination), and a destination written twice (a fork's slot freed and taken
        again) keeps its last source."""
        copies, self._state_copies = self._state_copies, []
        origin: dict[int, int] = {}
        for src, dst in copies:
            origin[dst] = origin.get(src, src)
        return [(src, dst) for dst, src in origin.items()]

    def get_state_slot(self, request: Request) -> int:
        """The request's recurrent-state slot; -1 for a model without one."""
        return -1 if self.state_pool is None else self.state_pool.slot_of(request.req_id)

    def get_blocks(self, request: Request) -> list[PhysicalTokenBlock]:
        """The request's blocks themselves (their ref counts and locations), for checks."""
        return list(self._tables[request.req_id])

    def take_block_table_diff(self, request: Request) -> tuple[int, list[int]] | None:
        """The entries of the request's table changed since the workers last saw it, as
        (first changed index, block ids from there on), and mark them seen."""
        first = self._first_unsent[request.req_id]
        if first is None:
            return None
        self._first_unsent[request.req_id] = None
        return first, self._block_ids[request.req_id][first:]

    def has_unsent_blocks(self, request: Request) -> bool:
        return self._first_unsent[request.req_id] is not None

    def mark_sent(self, request: Request) -> None:
        """The workers have been sent the request's whole table."""
        self._first_unsent[request.req_id] = None

    def get_num_requests_with_blocks(self) -> int:
        return len(self._tables)

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu_allocator.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_allocator.get_num_free_blocks()

    # --- helpers --------------------------------------------------------------------------

    def _table_index(self, req_id: int, logical: int) -> int | None:
        """Table entry of logical block ``logical``: None when it was dropped."""
        if logical < self.num_sink_blocks:
            return logical
        index = logical - self._num_dropped[req_id]
        return index if index >= self.num_sink_blocks else None

    def _write_index(self, request: Request) -> int:
        """Table entry of the block the request's next token goes into (``len(table)`` or more
        when it is still to be allocated). That token is past every dropped block, hence past the
        sink blocks too, so the dropped count is all there is to subtract."""
        return request.num_computed_tokens // self.block_size - self._num_dropped[request.req_id]

    def _num_logical(self, request: Request) -> int:
        """Logical blocks the request has had: those held plus those dropped."""
        return len(self._tables[request.req_id]) + self._num_dropped[request.req_id]

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _set_table(self, req_id: int, table: BlockTable) -> None:
        self._tables[req_id] = table
        self._block_ids[req_id] = [block.block_number for block in table]
        self._first_unsent[req_id] = 0

    def _mark_unsent(self, req_id: int, index: int) -> None:
        first = self._first_unsent[req_id]
        self._first_unsent[req_id] = index if first is None else min(first, index)
