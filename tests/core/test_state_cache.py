"""The recurrent-state slots of hybrid models, as the KV cache manager hands them out: one per
admitted request, admission waits when none is free, freed with the blocks, kept while swapped,
a fork's own slot filled with a copy of its parent's state, and prefix caching off (a cached
block holds no state)."""

from __future__ import annotations

import itertools
import logging

import pytest

from pagedllm.core.kv_cache_manager import AllocStatus, KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.state_cache import StateSlotPool
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
_ids = itertools.count()


def make_request(prompt_len: int) -> Request:
    return Request(next(_ids), list(range(prompt_len)), SamplingParams(max_tokens=4), BLOCK_SIZE)


def test_pool_hands_out_distinct_slots_and_takes_them_back() -> None:
    pool = StateSlotPool(3)
    slots = [pool.allocate(req_id) for req_id in (10, 11, 12)]
    assert sorted(slots) == [0, 1, 2] and not pool.can_allocate()
    assert pool.allocate(11) == slots[1]  # a holder keeps its slot
    pool.free(11)
    pool.free(11)  # a no-op the second time
    assert pool.get_num_free_slots() == 1 and pool.allocate(13) == slots[1]
    with pytest.raises(RuntimeError, match="out of state slots"):
        pool.allocate(14)


def test_admission_waits_for_a_free_slot_and_free_returns_it() -> None:
    kv = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=64, num_cpu_blocks=8, num_state_slots=2)
    first, second, third = make_request(5), make_request(9), make_request(3)
    for request in (first, second):
        assert kv.can_allocate(request) == AllocStatus.OK
        kv.allocate(request)
    assert {kv.get_state_slot(first), kv.get_state_slot(second)} == {0, 1}
    assert kv.can_allocate(third) == AllocStatus.LATER  # blocks to spare, but no slot
    slot = kv.get_state_slot(first)
    kv.free(first)  # finish, abort and preemption by recompute all free this way
    assert kv.can_allocate(third) == AllocStatus.OK
    kv.allocate(third)
    assert kv.get_state_slot(third) == slot


def test_a_swapped_request_keeps_its_slot() -> None:
    kv = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=16, num_cpu_blocks=16, num_state_slots=2)
    request = make_request(6)
    kv.allocate(request)
    slot = kv.get_state_slot(request)
    kv.swap_out([request])
    assert kv.get_state_slot(request) == slot and kv.state_pool.get_num_free_slots() == 1
    kv.swap_in([request])
    assert kv.get_state_slot(request) == slot


def test_models_without_state_have_no_slot() -> None:
    kv = KVCacheManager(BLOCK_SIZE, num_gpu_blocks=16, num_cpu_blocks=0)
    request = make_request(3)
    kv.allocate(request)
    assert kv.state_pool is None and kv.get_state_slot(request) == -1


def test_prefix_caching_is_turned_off_with_a_logged_reason(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="pagedllm.core.kv_cache_manager"):
        kv = KVCacheManager(BLOCK_SIZE, 16, 0, enable_prefix_caching=True, num_state_slots=2)
    assert not kv.enable_prefix_caching
    assert "prefix caching disabled" in caplog.text
    first, second = make_request(12), make_request(12)  # the same tokens
    kv.allocate(first)
    kv.cache_blocks(first, 12)
    kv.allocate(second)
    assert second.num_computed_tokens == 0  # nothing reused: its state must be computed


def test_a_fork_takes_a_slot_of_its_own_and_a_copy_of_its_parents_state() -> None:
    kv = KVCacheManager(BLOCK_SIZE, 16, 0, num_state_slots=3)
    parent, child, grandchild = make_request(6), make_request(6), make_request(6)
    kv.allocate(parent)
    kv.fork(parent, child)
    kv.fork(child, grandchild)
    slots = [kv.get_state_slot(r) for r in (parent, child, grandchild)]
    assert len(set(slots)) == 3
    assert kv.get_blocks(child) == kv.get_blocks(parent)  # the blocks are shared, the state is not
    # Handed to the next step once, as one gather: the grandchild copies the parent's rows, which
    # the child's slot holds only after the copies.
    assert kv.take_state_copies() == [(slots[0], slots[1]), (slots[0], slots[2])]
    assert kv.take_state_copies() == []
    kv.free(child)
    assert kv.state_pool.get_num_free_slots() == 1
    kv.fork(parent, make_request(6))  # takes the slot the child gave back
    with pytest.raises(RuntimeError, match="no state slot left"):
        kv.fork(parent, make_request(6))


def test_a_slot_freed_and_forked_into_again_keeps_its_last_source() -> None:
    kv = KVCacheManager(BLOCK_SIZE, 16, 0, num_state_slots=3)
    first, second = make_request(6), make_request(6)
    for request in (first, second):
        kv.allocate(request)
    child = make_request(6)
    kv.fork(first, child)
    slot = kv.get_state_slot(child)
    kv.free(child)  # aborted before the next step
    kv.fork(second, make_request(6))  # takes the same slot
    assert kv.take_state_copies() == [(kv.get_state_slot(second), slot)]
