"""The KV cache manager's invariants (DESIGN.md section 4), copy-on-write, swapping, and the
block table diffs the workers are sent."""

import itertools

import numpy as np
import pytest

from pagedllm.core.block_pool import BlockAllocator, CachingBlockAllocator, Device, NoFreeBlocksError
from pagedllm.core.kv_cache_manager import AllocStatus, KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.step_inputs import compute_slot_mapping

BLOCK_SIZE = 4
_ids = itertools.count()


def make_request(prompt_len: int, best_of: int = 1) -> Request:
    params = SamplingParams(n=best_of, temperature=1.0 if best_of > 1 else 0.0)
    return Request(next(_ids), list(range(prompt_len)), params, BLOCK_SIZE)


def check_ref_counts(bm: KVCacheManager, requests: list[Request]) -> None:
    """Every block's ref count equals the number of block tables holding it; the rest are free."""
    assert bm.get_num_requests_with_blocks() == len(requests)
    holders: dict[tuple[Device, int], int] = {}
    for request in requests:
        for block in bm.get_blocks(request):
            key = (block.device, block.block_number)
            holders[key] = holders.get(key, 0) + 1
            assert block.ref_count >= 1
    for request in requests:
        for block in bm.get_blocks(request):
            assert block.ref_count == holders[(block.device, block.block_number)]
    num_used = {d: sum(1 for dev, _ in holders if dev == d) for d in Device}
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks - num_used[Device.DEVICE]
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks - num_used[Device.CPU]


def fork(bm: KVCacheManager, parent: Request) -> Request:
    child = parent.fork(next(_ids))
    bm.fork(parent, child)
    return child


def append_token(bm: KVCacheManager, request: Request, token_id: int = 7) -> tuple[int, int] | None:
    """A decode step: the request's newest token gets a slot (and is then computed)."""
    request.append_output_token(token_id, 0.0)
    request.num_computed_tokens = request.num_tokens - 1
    cow = bm.append_slots(request)
    request.num_computed_tokens = request.num_tokens
    return cow


def test_allocator_free_list_and_double_free():
    allocator = BlockAllocator(Device.DEVICE, BLOCK_SIZE, 2)
    a, b = allocator.allocate(), allocator.allocate()
    assert {a.block_number, b.block_number} == {0, 1}
    assert a.ref_count == b.ref_count == 1
    with pytest.raises(NoFreeBlocksError):
        allocator.allocate()
    a.ref_count += 1
    allocator.free(a)
    assert allocator.get_num_free_blocks() == 0
    allocator.free(a)
    assert allocator.get_num_free_blocks() == 1
    with pytest.raises(ValueError, match="double free"):
        allocator.free(a)


def test_allocator_reuses_the_last_freed_block_first_then_hands_out_unused_ones_in_order():
    allocator = BlockAllocator(Device.DEVICE, BLOCK_SIZE, 5)
    a, b, c = (allocator.allocate() for _ in range(3))
    assert [a.block_number, b.block_number, c.block_number] == [0, 1, 2]
    allocator.free(a)
    allocator.free(c)
    assert allocator.get_num_free_blocks() == 4
    assert [allocator.allocate().block_number for _ in range(4)] == [2, 0, 3, 4]
    assert allocator.get_num_free_blocks() == 0


def test_a_caching_allocator_evicts_only_once_no_block_is_free():
    allocator = CachingBlockAllocator(Device.DEVICE, BLOCK_SIZE, 3)
    cached = allocator.allocate()
    allocator.register(cached, block_hash=7)
    allocator.free(cached)  # unreferenced, still findable
    assert allocator.get_num_free_blocks() == 3
    assert [allocator.allocate().block_number for _ in range(2)] == [1, 2]
    assert allocator.peek(7) is cached
    assert allocator.allocate() is cached and allocator.peek(7) is None and cached.block_hash is None
    with pytest.raises(NoFreeBlocksError):
        allocator.allocate()


def test_allocate_gives_one_block_per_logical_block_and_free_returns_them():
    bm = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.0)
    seq = make_request(prompt_len=9)  # 3 logical blocks, the last with one token
    assert bm.can_allocate(seq) == AllocStatus.OK
    bm.allocate(seq)
    assert len(bm.get_block_ids(seq)) == 3
    assert bm.get_num_free_gpu_blocks() == 7
    check_ref_counts(bm, [seq])
    bm.free(seq)
    bm.free(seq)  # freeing twice is a no-op, not a double free
    assert bm.get_num_free_gpu_blocks() == 10


def test_can_allocate_respects_watermark_and_size():
    bm = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=100, num_cpu_blocks=0, watermark=0.1)
    assert bm.watermark_blocks == 10
    assert bm.can_allocate(make_request(prompt_len=90 * BLOCK_SIZE)) == AllocStatus.OK
    assert bm.can_allocate(make_request(prompt_len=91 * BLOCK_SIZE)) == AllocStatus.NEVER
    bm.allocate(make_request(prompt_len=50 * BLOCK_SIZE))
    assert bm.can_allocate(make_request(prompt_len=41 * BLOCK_SIZE)) == AllocStatus.LATER


def test_append_slots_adds_a_block_only_at_a_block_boundary():
    bm = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.0)
    seq = make_request(prompt_len=BLOCK_SIZE)
    bm.allocate(seq)
    seq.num_computed_tokens = BLOCK_SIZE
    assert len(bm.get_block_ids(seq)) == 1
    assert append_token(bm, seq) is None  # token 4 starts logical block 1
    assert len(bm.get_block_ids(seq)) == 2
    for _ in range(BLOCK_SIZE - 1):
        assert append_token(bm, seq) is None
        assert len(bm.get_block_ids(seq)) == 2
    check_ref_counts(bm, [seq])


def test_fork_shares_blocks_and_copy_on_write_splits_the_last_one():
    bm = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.0)
    parent = make_request(prompt_len=6, best_of=3)  # blocks: [full][2 of 4]
    bm.allocate(parent)
    parent.num_computed_tokens = 6
    children = [fork(bm, parent) for _ in range(2)]
    family = [parent, *children]
    shared = bm.get_blocks(parent)
    assert [b.ref_count for b in shared] == [3, 3]
    src = shared[1].block_number
    assert bm.get_num_free_gpu_blocks() == 8
    check_ref_counts(bm, family)

    # Each sequence writes its first output token into the shared partial block.
    copies = []
    for seq in family:
        copies.append(append_token(bm, seq, 100 + seq.req_id))
        check_ref_counts(bm, family)
    # The first two copy the shared block; the last is then its only holder and writes in place.
    assert copies[0] == (src, bm.get_block_ids(parent)[1])
    assert copies[1] == (src, bm.get_block_ids(children[0])[1])
    assert copies[2] is None
    assert bm.get_block_ids(children[1])[1] == src
    tables = [bm.get_block_ids(s) for s in family]
    assert len({t[0] for t in tables}) == 1, "the full prompt block stays shared"
    assert len({t[1] for t in tables}) == 3, "the written block is private to each sequence"
    for seq in family:
        bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 10


def test_swap_out_and_in_move_shared_blocks_once():
    bm = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=10, num_cpu_blocks=10, watermark=0.0)
    parent = make_request(prompt_len=6, best_of=2)
    bm.allocate(parent)
    parent.num_computed_tokens = 6
    group = [parent, fork(bm, parent)]
    for seq in group:
        append_token(bm, seq, 1)
    gpu_tables = {s.req_id: list(bm.get_block_ids(s)) for s in group}
    num_unique = len({b for t in gpu_tables.values() for b in t})
    assert num_unique == 3  # shared first block + one private block each

    assert bm.can_swap_out(group)
    mapping = bm.swap_out(group)
    assert len(mapping) == num_unique
    assert bm.get_num_free_gpu_blocks() == 10
    assert bm.get_num_free_cpu_blocks() == 10 - num_unique
    for seq in group:
        assert [mapping[b] for b in gpu_tables[seq.req_id]] == bm.get_block_ids(seq)
    check_ref_counts(bm, group)

    assert bm.can_swap_in(group) == AllocStatus.OK
    back = bm.swap_in(group)
    assert set(back) == set(mapping.values())
    assert bm.get_num_free_cpu_blocks() == 10
    assert bm.get_num_free_gpu_blocks() == 10 - num_unique
    check_ref_counts(bm, group)
    for seq in group:
        bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 10 and bm.get_num_free_cpu_blocks() == 10


def test_can_swap_out_needs_cpu_room():
    bm = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=10, num_cpu_blocks=1, watermark=0.0)
    seq = make_request(prompt_len=8)
    bm.allocate(seq)
    assert not bm.can_swap_out([seq])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_slot_mapping_formula(block_size):
    block_table = [5, 2, 9, 0]
    positions = np.arange(1, 3 * block_size + 1)
    slots = compute_slot_mapping(np.asarray(block_table), positions, block_size)
    # The batched form: one block table row per token.
    rows = compute_slot_mapping(np.tile(block_table, (len(positions), 1)), positions, block_size)
    assert rows.tolist() == slots.tolist()
    expected = [
        block_table[p // block_size] * block_size + p % block_size for p in range(1, 3 * block_size + 1)
    ]
    assert slots.tolist() == expected


def test_block_table_diffs_report_appends_and_copy_on_write_once():
    bm = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.0)
    parent = make_request(prompt_len=6)
    bm.allocate(parent)
    parent.num_computed_tokens = 6
    assert bm.take_block_table_diff(parent) == (0, bm.get_block_ids(parent))
    assert bm.take_block_table_diff(parent) is None, "a diff is taken once"
    child = fork(bm, parent)
    bm.mark_sent(child)  # a fork is sent to the workers in full
    append_token(bm, parent)  # writes into the shared second block: copy-on-write at index 1
    assert bm.take_block_table_diff(parent) == (1, bm.get_block_ids(parent)[1:])
    for _ in range(2):
        append_token(bm, child)  # the child alone holds the old block now; the 8th token fills it
    assert bm.take_block_table_diff(child) is None
    append_token(bm, child)  # token 8 starts block 2
    assert bm.take_block_table_diff(child) == (2, bm.get_block_ids(child)[2:])


# --- sliding windows and attention sinks ------------------------------------------------------


def decode_in_window(bm: KVCacheManager, request: Request) -> None:
    """A decode step as the scheduler runs it: free what fell behind the window, then a slot."""
    request.append_output_token(7, 0.0)
    request.num_computed_tokens = request.num_tokens - 1
    bm.slide_window(request)
    assert bm.try_append_slot(request) is True
    request.num_computed_tokens = request.num_tokens


def check_window_visible(bm: KVCacheManager, request: Request, window: int, num_sinks: int) -> None:
    """Every slot the next query sees is in the table, at its cache position; the sinks' blocks
    are the first ones, untouched."""
    table = bm.get_block_ids(request)
    dropped = bm.get_num_dropped_tokens(request)
    query = request.num_computed_tokens - 1
    for position in range(max(query - window + 1, 0), query + 1):
        assert (position - dropped) // BLOCK_SIZE < len(table)
        assert position - dropped >= -(-num_sinks // BLOCK_SIZE) * BLOCK_SIZE or dropped == 0
    for position in range(min(num_sinks, query + 1)):
        assert position // BLOCK_SIZE < len(table)


@pytest.mark.parametrize("window, num_sinks", [(10, 0), (8, 0), (1, 0), (9, 5), (12, 4)])
def test_blocks_behind_the_window_are_freed_and_the_bound_holds(window, num_sinks):
    bm = KVCacheManager(BLOCK_SIZE, 40, 0, sliding_window=window, num_sink_tokens=num_sinks)
    request = make_request(3)
    bm.allocate(request)
    request.num_computed_tokens = 3
    sink_blocks = bm.get_block_ids(request)[: -(-num_sinks // BLOCK_SIZE)] if num_sinks else []
    bound = -(-num_sinks // BLOCK_SIZE) + -(-window // BLOCK_SIZE) + 1
    for _ in range(200):
        decode_in_window(bm, request)
        assert len(bm.get_blocks(request)) <= bound
        check_window_visible(bm, request, window, num_sinks)
        check_ref_counts(bm, [request])
        if num_sinks and request.num_tokens > num_sinks:
            assert bm.get_block_ids(request)[: len(sink_blocks)] == sink_blocks
    assert bm.get_num_dropped_tokens(request) > 0
    bm.free(request)
    assert bm.get_num_free_gpu_blocks() == 40


def test_a_long_prompt_drops_its_head_once_computed():
    bm = KVCacheManager(BLOCK_SIZE, 40, 0, sliding_window=6)
    request = make_request(30)  # 8 blocks at admission
    bm.allocate(request)
    assert len(bm.get_blocks(request)) == 8
    assert not bm.slide_window(request)  # nothing computed yet: every block is still ahead
    request.num_computed_tokens = 30
    assert bm.slide_window(request)
    # The next query (position 30) sees 25..30: blocks 6 and 7; block 7 gets position 30's slot.
    assert bm.get_num_dropped_tokens(request) == 24
    assert len(bm.get_blocks(request)) == 2
    assert bm.get_num_free_gpu_blocks() == 38
    assert bm.take_block_table_diff(request) == (0, bm.get_block_ids(request))


def test_siblings_share_window_blocks_until_both_leave_them():
    bm = KVCacheManager(BLOCK_SIZE, 40, 0, sliding_window=5)
    parent = make_request(8, best_of=2)
    bm.allocate(parent)
    parent.num_computed_tokens = 8
    child = fork(bm, parent)
    for _ in range(3):
        decode_in_window(bm, parent)
    check_ref_counts(bm, [parent, child])
    # The parent left block 0 behind; the child (still at position 8) holds it alone.
    assert bm.get_num_dropped_tokens(parent) > bm.get_num_dropped_tokens(child) == 0
    for _ in range(3):
        decode_in_window(bm, child)
    check_ref_counts(bm, [parent, child])
    bm.free(parent)
    bm.free(child)
    assert bm.get_num_free_gpu_blocks() == 40


def test_swapping_keeps_the_dropped_count():
    bm = KVCacheManager(BLOCK_SIZE, 20, 20, sliding_window=6, num_sink_tokens=2)
    request = make_request(20)
    bm.allocate(request)
    request.num_computed_tokens = 20
    decode_in_window(bm, request)
    dropped, num_held = bm.get_num_dropped_tokens(request), len(bm.get_blocks(request))
    bm.swap_out([request])
    assert bm.can_swap_in([request]) == AllocStatus.OK
    bm.swap_in([request])
    assert (bm.get_num_dropped_tokens(request), len(bm.get_blocks(request))) == (dropped, num_held)
    decode_in_window(bm, request)
    check_window_visible(bm, request, 6, 2)
    check_ref_counts(bm, [request])


def test_sinks_need_a_window():
    with pytest.raises(ValueError, match="num_sink_tokens"):
        KVCacheManager(BLOCK_SIZE, 10, 0, num_sink_tokens=4)


def test_a_copy_on_write_taken_back_shares_the_block_again():
    """A request preempted in the step that gave it a copy-on-write gives the copy back: a swap
    out would otherwise move the copy before the workers fill it."""
    bm = KVCacheManager(BLOCK_SIZE, 10, 10)
    parent = make_request(6, best_of=2)
    bm.allocate(parent)
    parent.num_computed_tokens = 6
    child = fork(bm, parent)
    bm.start_step()
    shared = bm.get_block_ids(parent)[1]
    src, dst = append_token(bm, parent)
    assert src == shared != dst
    assert bm.undo_copy_on_write(parent) == (src, dst)
    assert bm.get_block_ids(parent)[1] == shared
    check_ref_counts(bm, [parent, child])
    assert bm.undo_copy_on_write(parent) is None
    bm.swap_out([parent, child])
    assert bm.get_num_free_gpu_blocks() == 10


def test_a_request_longer_than_the_block_table_is_never_given_all_its_blocks():
    """With attention sinks a request outgrows max_model_len; recomputing it would need a table
    wider than the workers'."""
    bm = KVCacheManager(BLOCK_SIZE, 40, 0, sliding_window=8, num_sink_tokens=4, max_blocks_per_request=4)
    assert bm.can_allocate(make_request(16)) == AllocStatus.OK
    assert bm.can_allocate(make_request(17)) == AllocStatus.NEVER
