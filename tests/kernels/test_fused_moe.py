"""The fused MoE kernel (pagedllm.kernels.triton.fused_moe) against the torch path, the torch path
against a per-token reference, the router against Hugging Face's, and the sort-and-pad indices.

Runs on the CPU under TRITON_INTERPRET=1 (set by conftest.py when there is no GPU), else on CUDA;
tests/gpu/test_fused_moe_gpu.py adds bfloat16 and model sizes on the device.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the fused MoE kernel needs the triton package")

from pagedllm.kernels.triton import moe_align
from pagedllm.kernels.triton.fused_moe import (
    MoeLaunch,
    default_launch,
    fused_moe,
    invariant_launch,
)
from pagedllm.kernels.triton.moe_align import moe_align_block_size
from pagedllm.layers.fused_moe import fused_experts_torch, select_experts

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-2)}

# (num_tokens, num_experts, top_k, hidden_size, intermediate_size): one token; sizes that are no
# multiple of any tile (masks); many experts with few pairs each (decode tiles, 16 rows); a
# dozen pairs per expert; many pairs per expert (prefill tiles, 64 rows) and the 32-row middle.
SHAPES = [
    (1, 4, 1, 64, 32),
    (3, 8, 2, 48, 40),
    (17, 64, 8, 64, 64),
    (64, 16, 2, 128, 96),
    (300, 32, 2, 64, 48),
    (130, 8, 8, 64, 32),
    (257, 4, 1, 32, 80),
]


def _inputs(num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=gen) / intermediate**0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


def _per_token_reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """Each token, each of its slots, one expert at a time: the definition, in float64."""
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    intermediate = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, expert in enumerate(ids[t].tolist()):
            gate_up = w13[expert] @ x[t]
            act = F.silu(gate_up[:intermediate]) * gate_up[intermediate:]
            out[t] += weights[t, j] * (w2[expert] @ act)
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "t{}-e{}-k{}-h{}-i{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_torch_path(shape: tuple, dtype: torch.dtype) -> None:
    x, w13, w2, weights, ids = _inputs(*shape, dtype)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = fused_experts_torch(x, w13, w2, weights, ids)
    assert out.shape == ref.shape == x.shape and out.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "launch",
    [
        MoeLaunch(16, 32, 32, 1, 4, 2),
        MoeLaunch(32, 16, 64, 2, 4, 2),
        MoeLaunch(64, 64, 16, 8, 4, 2),
        MoeLaunch(32, 64, 32, 2, 4, 2, gate_up_block_n=16),  # the gated GEMM's own column tiles
    ],
    ids=lambda launch: (
        f"m{launch.block_m}-n{launch.block_n}-k{launch.block_k}-g{launch.group_m}-gu{launch.gate_up_block_n}"
    ),
)
def test_kernel_matches_torch_path_at_other_tiles(launch: MoeLaunch) -> None:
    x, w13, w2, weights, ids = _inputs(45, 8, 2, 80, 48, torch.float32, seed=1)
    out = fused_moe(x, w13, w2, weights, ids, launch)
    torch.testing.assert_close(out, fused_experts_torch(x, w13, w2, weights, ids), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("shape", [(3, 8, 2, 48, 40), (130, 8, 8, 64, 32), (45, 8, 2, 80, 48)], ids=str)
def test_weights_loaded_by_tma_descriptor_match_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, shape: tuple
) -> None:
    """The TMA weight loads (Hopper's path, taken here under the interpreter too): a box past an
    expert's N columns or past K reads neighbouring rows or zeros, which no stored column uses."""
    import pagedllm.kernels.triton.fused_moe as fused

    taken = []
    monkeypatch.setattr(fused, "weights_by_tma", lambda weights: taken.append(weights.shape) or True)
    x, w13, w2, weights, ids = _inputs(*shape, torch.float16)
    for launch in (None, MoeLaunch(16, 32, 32, 1, 4, 2, gate_up_block_n=16, down_num_warps=2)):
        taken.clear()
        out = fused_moe(x, w13, w2, weights, ids, launch)
        assert taken == [w13.shape, w2.shape]
        torch.testing.assert_close(out, fused_experts_torch(x, w13, w2, weights, ids), atol=2e-3, rtol=2e-2)


def test_weights_by_tma_only_where_the_copy_engine_can_address_them() -> None:
    import pagedllm.kernels.triton.fused_moe as fused

    w = torch.zeros(4, 64, 128, dtype=torch.bfloat16)
    assert not fused.weights_by_tma(w)  # no TMA on the CPU (nor before Hopper)
    if DEVICE.type == "cuda" and torch.cuda.get_device_capability()[0] >= 9:
        w = w.to(DEVICE)
        assert fused.weights_by_tma(w)
        assert not fused.weights_by_tma(w.float())  # 16-bit only
        # rows 200 bytes apart: not 16-byte aligned
        assert not fused.weights_by_tma(torch.zeros(4, 64, 100, dtype=torch.bfloat16, device=DEVICE))
        assert not fused.weights_by_tma(w[:, :32])  # experts' matrices not one [E * rows, K]


def test_kernel_with_every_token_on_the_same_experts() -> None:
    # One expert's run spans many tiles; the other experts get nothing.
    x, w13, w2, weights, _ = _inputs(70, 16, 2, 64, 32, torch.float32, seed=2)
    ids = torch.tensor([[3, 11]] * 70, device=DEVICE)
    out = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, fused_experts_torch(x, w13, w2, weights, ids), atol=2e-5, rtol=2e-5)


def test_torch_path_matches_the_per_token_definition() -> None:
    x, w13, w2, weights, ids = _inputs(9, 8, 3, 32, 24, torch.float32, seed=3)
    expected = _per_token_reference(x, w13, w2, weights, ids).float()
    torch.testing.assert_close(fused_experts_torch(x, w13, w2, weights, ids), expected, atol=1e-5, rtol=1e-5)


class _LaunchSpy:
    """Stands in for a kernel: notes each launch's name, then launches it."""

    def __init__(self, name: str, kernel, launched: list[str]) -> None:
        self.name, self.kernel, self.launched = name, kernel, launched

    def __getitem__(self, grid):
        self.launched.append(self.name)
        return self.kernel[grid]


# Past 1,024 pairs the count and place kernels run several programs, and the one-program kernel
# loops; (3, 300, 2, 32) has more experts than pairs; (700, 4, 2, 128) one expert's run long enough
# that padding fills span programs. Each case runs both launch shapes (the pair count chooses).
@pytest.mark.parametrize("one_program", [True, False], ids=["one-program", "three-kernels"])
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,block_m",
    [(1, 4, 1, 16), (37, 8, 2, 16), (50, 64, 8, 32), (3, 300, 2, 32), (300, 128, 8, 16), (700, 4, 2, 128)],
)
def test_align_block_size_sorts_and_pads_each_expert(
    num_tokens, num_experts, top_k, block_m, one_program, monkeypatch
) -> None:
    monkeypatch.setattr(moe_align, "ONE_PROGRAM_PAIRS", 1 << 30 if one_program else 0)
    launched: list[str] = []
    for name in ("_moe_align_one_program_kernel", "_moe_count_kernel"):
        monkeypatch.setattr(moe_align, name, _LaunchSpy(name, getattr(moe_align, name), launched))
    _, _, _, _, ids = _inputs(num_tokens, num_experts, top_k, 16, 16, torch.float32, seed=num_tokens)
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(ids, block_m, num_experts)
    assert launched == ["_moe_align_one_program_kernel" if one_program else "_moe_count_kernel"]
    num_pairs = num_tokens * top_k
    flat = ids.flatten().tolist()
    counts = [flat.count(e) for e in range(num_experts)]
    padded = [-(-c // block_m) * block_m for c in counts]
    assert int(num_post_padded) == sum(padded)
    # The buffer's length is fixed by the pair count alone (CUDA graphs) and holds the worst case.
    assert (
        sorted_ids.numel()
        == -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m) * block_m
    )
    assert sorted_ids.numel() >= sum(padded) and expert_ids.numel() == sorted_ids.numel() // block_m
    sorted_list, start = sorted_ids.tolist(), 0
    for expert in range(num_experts):
        run = sorted_list[start : start + padded[expert]]
        pairs = [p for p in run if p != num_pairs]
        # This expert's pairs, each once, in any order, then padding to the tile.
        assert sorted(pairs) == [p for p in range(num_pairs) if flat[p] == expert]
        assert run[len(pairs) :] == [num_pairs] * (padded[expert] - len(pairs))
        assert expert_ids[start // block_m : (start + padded[expert]) // block_m].tolist() == [expert] * (
            padded[expert] // block_m
        )
        start += padded[expert]
    assert set(sorted_list[start:]) <= {num_pairs}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batch_invariant_tokens_are_the_same_bits_alone_and_in_batches(dtype: torch.dtype) -> None:
    """``batch_invariant=True``: a token's output does not depend on the batch, although its
    experts' pair counts (which choose the default launch's tiles) grow with it: one launch
    (``invariant_launch``), the slots added in slot order; and it agrees with the torch path."""
    x, w13, w2, weights, ids = _inputs(300, 16, 4, 64, 48, dtype, seed=5)
    batch = fused_moe(x, w13, w2, weights, ids, batch_invariant=True)
    assert default_launch(300 * 4, 16, dtype) != invariant_launch(dtype)  # the default would move
    for rows in (slice(0, 1), slice(7, 9), slice(100, 164)):
        alone = fused_moe(x[rows], w13, w2, weights[rows], ids[rows], batch_invariant=True)
        assert torch.equal(alone, batch[rows]), rows
    expected = fused_experts_torch(x, w13, w2, weights, ids)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(batch, expected, atol=atol, rtol=rtol)


def test_warm_up_compiles_every_tier_a_step_can_reach(monkeypatch: pytest.MonkeyPatch) -> None:
    """``warm_up`` runs each launch ``default_launch`` can choose (16- to 128-row tiles, both GEMMs),
    but none that needs more tokens than a step may hold."""
    import pagedllm.kernels.triton.fused_moe as fused

    launched: list[tuple[int, bool]] = []
    monkeypatch.setattr(fused, "_launch_gemm", lambda *args: launched.append((args[-1].block_m, args[-2])))
    _, w13, w2, _, _ = _inputs(1, 8, 2, 32, 16, torch.float32)
    fused.warm_up(w13, w2, top_k=2, max_num_tokens=10_000)
    assert sorted(set(launched)) == [(m, gated) for m in (16, 32, 64, 128) for gated in (False, True)]
    launched.clear()
    fused.warm_up(w13, w2, top_k=2, max_num_tokens=100)  # 8 experts x 49 pairs / 2 = 196 tokens
    assert sorted({m for m, _ in launched}) == [16, 32]


def test_default_launch_by_pairs_per_expert() -> None:
    # Decode (64 tokens, top-8 of 128: 4 pairs per expert) takes 16-row tiles, 256 tokens 32-row
    # ones; a prefill chunk of 8,192 tokens 128-row ones.
    assert default_launch(64 * 8, 128, torch.bfloat16).block_m == 16
    assert default_launch(256 * 8, 128, torch.bfloat16).block_m == 32
    assert default_launch(8192 * 8, 128, torch.bfloat16).block_m == 128
    assert (
        default_launch(8192 * 8, 128, torch.float32).block_k
        == default_launch(8192 * 8, 128, torch.bfloat16).block_k // 2
    )


def test_zero_tokens() -> None:
    x, w13, w2, weights, ids = _inputs(0, 4, 2, 32, 16, torch.float32)
    assert fused_moe(x, w13, w2, weights, ids).shape == (0, 32)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_router_matches_hf(norm_topk_prob: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(
        hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob
    )
    router = Qwen3MoeTopKRouter(config)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=gen))
        hidden = torch.randn(11, 32, generator=gen)
        logits, hf_weights, hf_ids = router(hidden)
    weights, ids = select_experts(logits, 4, norm_topk_prob)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)
