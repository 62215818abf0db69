"""What LoRABatch launches, step by step, on the kernel path (kernels/triton/lora_sgmv.py and
lora.py, chosen in lora/punica.py): which kernel each step runs; decode's SGMV over a grid fixed by
the token count (what a CUDA graph captured at that count replays), its split-K sums against the
dense reference; and that no step launches a variant Triton has not compiled at warm-up (compile
keys recorded as Triton's own binder makes them, nothing run). On the CPU the kernels run under
TRITON_INTERPRET=1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.kernels.triton import lora, lora_sgmv
from pagedllm.lora.punica import NO_SLOT, SGMV_DECODE_MIN_TOKENS, LoRABatch
from tests.kernels.test_lora_sgmv import (
    DEVICE,
    MAX_RANK,
    dense_reference,
    random_adapters,
    run_sgmv,
    slice_starts,
    stack,
)

KERNELS = ("_sgmv_shrink_kernel", "_sgmv_expand_kernel")


def unspecialized(kernel):
    """A Triton kernel's ``do_not_specialize`` (kept in its options when interpreted)."""
    if hasattr(kernel, "do_not_specialize"):
        return kernel.do_not_specialize
    return kernel.kwargs.get("do_not_specialize")


class RecordedKernel:
    """Stands in for a Triton kernel: records each launch's compile key, as Triton's own binder
    makes it (constexprs, argument types, and the specialisation of integers (== 1, multiple of
    16) and pointers (16-byte aligned)), its grid and its tensor arguments' addresses; runs
    nothing."""

    def __init__(self, kernel):
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        # Interpreted or compiled, with the kernel's own do_not_specialize.
        jit = JITFunction(kernel.fn, do_not_specialize=unspecialized(kernel))
        self.binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
        self.keys, self.launches = [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _, specialization, options = self.binder(*args, **kwargs)
            self.keys.append((repr(specialization), tuple(sorted(options.items()))))
            pointers = tuple(a.data_ptr() for a in args if isinstance(a, torch.Tensor))
            self.launches.append((grid, pointers, self.keys[-1]))

        return launch


@pytest.fixture
def recorded(monkeypatch):
    """{kernel name: RecordedKernel} standing in for SGMV's two kernels."""
    kernels = {name: RecordedKernel(getattr(lora_sgmv, name)) for name in KERNELS}
    for name, recorder in kernels.items():
        monkeypatch.setattr(lora_sgmv, name, recorder)
    return kernels


def test_the_recorder_sees_the_kernels_do_not_specialize():
    # The split count and h's split stride follow the step's size: not compile keys.
    assert "stride_hs" in unspecialized(lora_sgmv._sgmv_shrink_kernel)
    assert {"split_k", "stride_hs"} <= set(unspecialized(lora_sgmv._sgmv_expand_kernel))


def test_warm_up_compiles_every_variant_a_step_launches(recorded):
    num_slots, generator = 8, torch.Generator().manual_seed(0)
    # (slice sizes, in): q/k/v, gate/up, o, down as in a small model, each slot buffer as the
    # LoRA layers allocate it.
    projections = []
    for sizes, in_features in (((48, 16, 16), 32), ((64, 64), 32), ((32,), 48), ((32,), 200)):
        n = len(sizes)
        lora_a = torch.randn(n * num_slots * MAX_RANK, in_features, generator=generator)
        lora_b = torch.randn(sum(sizes), n * num_slots * MAX_RANK, generator=generator)
        projections.append((lora_a, lora_b, slice_starts(sizes)))
    batch = LoRABatch(
        num_slots, MAX_RANK, 20000, {1, 2, 3}, torch.float32, torch.device("cpu"), use_kernels=True
    )
    batch.warm_up(projections + projections)  # each distinct projection once
    warmed = {name: set(k.keys) for name, k in recorded.items()}
    # Per kernel: a launch per distinct projection and variant, tiles of 64, of 16, of 16 with K
    # split (projections Triton specialises alike share a variant).
    assert all(len(k.keys) == len(projections) * 3 for k in recorded.values())
    rng = np.random.default_rng(0)
    block_ms, splits = set(), set()
    steps = [(n, True) for n in (1, 2, 7, 61, 333, 4097, 16383, 16384 + 13, 19999)]
    steps += [(n, False) for n in (16, 40, 255, 256)]  # decode steps that run SGMV
    for num_tokens, has_prefill in steps:
        token_slots = rng.integers(NO_SLOT, num_slots, num_tokens)
        batch.set_token_slots(token_slots, has_prefill)
        block_ms.add(batch._segments.block_m)
        for lora_a, lora_b, starts in projections:
            x = torch.zeros(num_tokens, lora_a.shape[1])
            y = torch.zeros(num_tokens, lora_b.shape[0])
            batch.apply(y, x, lora_a, lora_b, lora_a.shape[0] // (num_slots * MAX_RANK), starts)
            splits.add(recorded["_sgmv_shrink_kernel"].launches[-1][0][1])
    # The steps reached every tile height and several split counts.
    assert block_ms == set(lora_sgmv.BLOCK_MS) and len(splits) >= 3
    for name, recorder in recorded.items():
        assert set(recorder.keys) <= warmed[name], f"{name} compiled a variant inside a step"


def test_decode_launches_depend_on_the_token_count_only(recorded):
    """A CUDA graph captured at T tokens (over a plan without tiles) replays every later decode
    step of T tokens: each launch's grid, compile key and plan addresses are the capture's."""
    num_slots, num_tokens = 4, 40
    generator = torch.Generator().manual_seed(1)
    lora_a = torch.randn(3 * num_slots * MAX_RANK, 200, generator=generator)
    lora_b = torch.randn(96, 3 * num_slots * MAX_RANK, generator=generator)
    x, y = torch.zeros(num_tokens, 200), torch.zeros(num_tokens, 96)
    batch = LoRABatch(num_slots, MAX_RANK, 256, {3}, torch.float32, torch.device("cpu"), use_kernels=True)
    batch.set_token_slots(np.empty(0, dtype=np.int64))  # as before capture (prepare_capture)
    rng = np.random.default_rng(2)
    steps = [None, np.full(num_tokens, 2), rng.integers(NO_SLOT, num_slots, num_tokens)]
    steps.append(np.full(num_tokens, NO_SLOT))
    for token_slots in steps:
        if token_slots is not None:
            batch.set_token_slots(token_slots)
        batch.apply(y, x, lora_a, lora_b, 3, (64, 80))
    # h (the shrink's first tensor, the expand's second) is the launch's own temporary: under a
    # graph, at the address the graph's memory pool gave it at capture.
    for name, h_index in zip(KERNELS, (0, 1)):
        launches = [
            (grid, pointers[:h_index] + pointers[h_index + 1 :], key)
            for grid, pointers, key in recorded[name].launches
        ]
        assert len(launches) == len(steps) and all(launch == launches[0] for launch in launches)
    (grid, _, _), *_ = recorded["_sgmv_shrink_kernel"].launches
    assert grid[0] == lora_sgmv.max_tiles(num_tokens, 16, num_slots) and grid[1] > 1  # split K


@pytest.mark.parametrize("num_tokens", [16, 40])
def test_decode_sgmv_over_a_fixed_grid_equals_the_dense_product(num_tokens):
    """Decode's plan: tiles of 16, the grid its token count's most tiles (programs past the
    step's tiles return at once), K split 4 ways (``in`` of 200: four chunks of 64); padding
    rows without adapter untouched."""
    rng = np.random.default_rng(num_tokens)
    token_slots = rng.integers(NO_SLOT, 3, num_tokens)
    token_slots[-3:] = NO_SLOT  # a CUDA graph's padding rows
    buffer = lora_sgmv.SegmentBuffer(256, 3, DEVICE)
    plan = buffer.plan(token_slots, 16, fixed_grid=True)
    assert plan.grid_tiles(num_tokens) > plan.num_tiles
    got, y, expected = run_sgmv(
        (40, 24, 24), [16, 4, 8], token_slots, torch.float32, in_features=200, plan=plan
    )
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-3)
    untouched = torch.from_numpy(token_slots == NO_SLOT)
    assert torch.equal(got.cpu()[untouched], y.cpu()[untouched])


def test_each_step_runs_the_kernel_its_shape_calls_for(monkeypatch):
    """A prefill step: SGMV over its exact tiles; a decode step: BGMV below
    SGMV_DECODE_MIN_TOKENS tokens, SGMV over a fixed grid from there; each gives the dense
    product."""
    generator = torch.Generator().manual_seed(5)
    slice_sizes, ranks = (24,), [8, 16]
    adapters = random_adapters(ranks, slice_sizes, generator)
    lora_a, lora_b = stack(adapters, slice_sizes, torch.float32)
    batch = LoRABatch(2, MAX_RANK, 32, {1}, torch.float32, DEVICE, use_kernels=True)
    ran = []
    for module, name in (
        (lora, "bgmv_shrink"),
        (lora, "bgmv_expand"),
        (lora_sgmv, "sgmv_shrink"),
        (lora_sgmv, "sgmv_expand"),
    ):
        kernel = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *args, kernel=kernel, name=name: ran.append(name) or kernel(*args)
        )
    rng = np.random.default_rng(0)
    for num_tokens, has_prefill, kernel, fixed_grid in (
        (5, True, "sgmv", False),
        (5, False, "bgmv", True),
        (SGMV_DECODE_MIN_TOKENS - 1, False, "bgmv", True),
        (SGMV_DECODE_MIN_TOKENS, False, "sgmv", True),
        (20, True, "sgmv", False),
    ):
        token_slots = rng.integers(NO_SLOT, 2, num_tokens)
        x = torch.randn(num_tokens, lora_a.shape[1], generator=generator).to(DEVICE)
        y = torch.zeros(num_tokens, 24, device=DEVICE)
        batch.set_token_slots(token_slots, has_prefill)
        ran.clear()
        batch.apply(y, x, lora_a, lora_b, 1, (24, 24))
        assert ran == [f"{kernel}_shrink", f"{kernel}_expand"] and batch._segments.fixed_grid == fixed_grid
        expected = dense_reference(torch.zeros(num_tokens, 24), x, adapters, slice_sizes, token_slots)
        torch.testing.assert_close(y.cpu(), expected, rtol=1e-4, atol=1e-4)
