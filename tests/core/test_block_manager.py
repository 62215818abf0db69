"""The block manager's invariants (DESIGN.md section 4), copy-on-write and swapping."""

import itertools

import pytest

from pagedllm.core.block_allocator import BlockAllocator, Device, NoFreeBlocksError
from pagedllm.core.block_manager import AllocStatus, BlockSpaceManager
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.worker.model_runner import compute_slot_mapping

BLOCK_SIZE = 4
_ids = itertools.count()


def make_group(prompt_len: int, best_of: int = 1) -> SequenceGroup:
    seq = Sequence(next(_ids), list(range(prompt_len)), BLOCK_SIZE)
    params = SamplingParams(n=best_of, temperature=1.0 if best_of > 1 else 0.0)
    return SequenceGroup(str(seq.seq_id), [seq], params)


def check_ref_counts(bm: BlockSpaceManager) -> None:
    """Every block's ref count equals the number of block tables holding it; the rest are free."""
    holders: dict[tuple[Device, int], int] = {}
    for table in bm.block_tables.values():
        for block in table:
            key = (block.device, block.block_number)
            holders[key] = holders.get(key, 0) + 1
            assert block.ref_count >= 1
    for table in bm.block_tables.values():
        for block in table:
            assert block.ref_count == holders[(block.device, block.block_number)]
    num_used = {d: sum(1 for dev, _ in holders if dev == d) for d in Device}
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks - num_used[Device.DEVICE]
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks - num_used[Device.CPU]


def start_running(bm: BlockSpaceManager, group: SequenceGroup) -> Sequence:
    bm.allocate(group)
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING
    return group.seqs[0]


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


def test_allocate_gives_one_block_per_logical_block_and_free_returns_them():
    bm = BlockSpaceManager(BLOCK_SIZE, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.0)
    group = make_group(prompt_len=9)  # 3 logical blocks, the last with one token
    assert bm.can_allocate(group) == AllocStatus.OK
    seq = start_running(bm, group)
    assert len(bm.get_block_table(seq)) == 3
    assert bm.get_num_free_gpu_blocks() == 7
    check_ref_counts(bm)
    bm.free(seq)
    bm.free(seq)  # freeing twice is a no-op, not a double free
    assert bm.get_num_free_gpu_blocks() == 10


def test_can_allocate_respects_watermark_and_size():
    bm = BlockSpaceManager(BLOCK_SIZE, num_gpu_blocks=100, num_cpu_blocks=0, watermark=0.1)
    assert bm.watermark_blocks == 10
    assert bm.can_allocate(make_group(prompt_len=90 * BLOCK_SIZE)) == AllocStatus.OK
    assert bm.can_allocate(make_group(prompt_len=91 * BLOCK_SIZE)) == AllocStatus.NEVER
    start_running(bm, make_group(prompt_len=50 * BLOCK_SIZE))
    assert bm.can_allocate(make_group(prompt_len=41 * BLOCK_SIZE)) == AllocStatus.LATER


def test_append_slots_adds_a_block_only_at_a_block_boundary():
    bm = BlockSpaceManager(BLOCK_SIZE, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.0)
    group = make_group(prompt_len=BLOCK_SIZE)
    seq = start_running(bm, group)
    assert len(bm.get_block_table(seq)) == 1
    seq.append_token_id(7, 0.0)  # token 4 starts logical block 1
    assert bm.append_slots(seq) is None
    assert len(bm.get_block_table(seq)) == 2
    for _ in range(BLOCK_SIZE - 1):
        seq.append_token_id(7, 0.0)
        assert bm.append_slots(seq) is None
        assert len(bm.get_block_table(seq)) == 2
    check_ref_counts(bm)


def test_fork_shares_blocks_and_copy_on_write_splits_the_last_one():
    bm = BlockSpaceManager(BLOCK_SIZE, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.0)
    group = make_group(prompt_len=6, best_of=3)  # blocks: [full][2 of 4]
    parent = start_running(bm, group)
    children = []
    for _ in range(2):
        child = parent.fork(next(_ids))
        bm.fork(parent, child)
        group.add(child)
        children.append(child)
    shared = list(bm.block_tables[parent.seq_id])
    assert [b.ref_count for b in shared] == [3, 3]
    src = shared[1].block_number
    assert bm.get_num_free_gpu_blocks() == 8
    check_ref_counts(bm)

    # Each sequence writes its first output token into the shared partial block.
    copies = []
    for seq in [parent, *children]:
        seq.append_token_id(100 + seq.seq_id, 0.0)
        copies.append(bm.append_slots(seq))
        check_ref_counts(bm)
    # The first two copy the shared block; the last is then its only holder and writes in place.
    assert copies[0] == (src, bm.get_block_table(parent)[1])
    assert copies[1] == (src, bm.get_block_table(children[0])[1])
    assert copies[2] is None
    assert bm.get_block_table(children[1])[1] == src
    tables = [bm.get_block_table(s) for s in [parent, *children]]
    assert len({t[0] for t in tables}) == 1, "the full prompt block stays shared"
    assert len({t[1] for t in tables}) == 3, "the written block is private to each sequence"
    for seq in [parent, *children]:
        bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 10


def test_swap_out_and_in_move_shared_blocks_once():
    bm = BlockSpaceManager(BLOCK_SIZE, num_gpu_blocks=10, num_cpu_blocks=10, watermark=0.0)
    group = make_group(prompt_len=6, best_of=2)
    parent = start_running(bm, group)
    child = parent.fork(next(_ids))
    bm.fork(parent, child)
    group.add(child)
    for seq in group.seqs:
        seq.append_token_id(1, 0.0)
        bm.append_slots(seq)
    gpu_tables = {s.seq_id: bm.get_block_table(s) for s in group.seqs}
    num_unique = len({b for t in gpu_tables.values() for b in t})
    assert num_unique == 3  # shared first block + one private block each

    assert bm.can_swap_out(group)
    mapping = bm.swap_out(group)
    for seq in group.seqs:
        seq.status = SequenceStatus.SWAPPED
    assert len(mapping) == num_unique
    assert bm.get_num_free_gpu_blocks() == 10
    assert bm.get_num_free_cpu_blocks() == 10 - num_unique
    for seq in group.seqs:
        assert [mapping[b] for b in gpu_tables[seq.seq_id]] == bm.get_block_table(seq)
    check_ref_counts(bm)

    assert bm.can_swap_in(group) == AllocStatus.OK
    back = bm.swap_in(group)
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING
    assert set(back) == set(mapping.values())
    assert bm.get_num_free_cpu_blocks() == 10
    assert bm.get_num_free_gpu_blocks() == 10 - num_unique
    check_ref_counts(bm)
    for seq in group.seqs:
        bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 10 and bm.get_num_free_cpu_blocks() == 10


def test_can_swap_out_needs_cpu_room():
    bm = BlockSpaceManager(BLOCK_SIZE, num_gpu_blocks=10, num_cpu_blocks=1, watermark=0.0)
    group = make_group(prompt_len=8)
    start_running(bm, group)
    assert not bm.can_swap_out(group)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_slot_mapping_formula(block_size):
    block_table = [5, 2, 9, 0]
    slots = compute_slot_mapping(block_table, start=1, end=3 * block_size + 1, block_size=block_size)
    expected = [
        block_table[p // block_size] * block_size + p % block_size for p in range(1, 3 * block_size + 1)
    ]
    assert slots.tolist() == expected
