"""The few-token weight-only GEMM (kernels/triton/skinny_gemm.py) against torch's dequantize-then-
matmul in float32: FP8 weights per tensor, per channel and in blocks, 4-bit weights in groups of
32/64/128 (and one group per row), M from 1 to 33, N and K off the tiles (run on the CPU under
TRITON_INTERPRET=1 at tiny shapes; on CUDA as well when there is one)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.triton.quant_gemm import pack_w4a16
from pagedllm.kernels.triton.skinny_gemm import group_in_tile, skinny_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small tiles, so that tiny shapes still cross several tiles of N and K (and their ragged edges).
SMALL = {"block_n": 16, "block_k": 32, "num_stages": 1}
# Both products (tensor-core DOT, register FMA), each over all of K and cut into up to three K
# ranges summed by the last program to arrive.
PRODUCTS = pytest.mark.parametrize(
    "product",
    [
        {"fma": 0, "num_splits": 1},
        {"fma": 1, "num_splits": 1},
        {"fma": 0, "num_splits": 3},
        {"fma": 1, "num_splits": 3},
    ],
    ids=["dot", "fma", "dot-split", "fma-split"],
)


def _fp8(n: int, k: int, scale_rows: int, group_k: int, generator: torch.Generator):
    """(e4m3 [N, K], float32 scales [cdiv(N, scale_rows), cdiv(K, group_k)], dequantized float32)."""
    q = (torch.randn(n, k, generator=generator) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // scale_rows), -(-k // group_k), generator=generator) * 0.01 + 0.001
    dense = q.float() * scale.repeat_interleave(scale_rows, 0)[:n].repeat_interleave(group_k, 1)[:, :k]
    return q, scale, dense


def _check(out: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    expected = x.float() @ dense.t()
    tol = 1e-4 if x.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


@pytest.mark.parametrize(
    ("scheme", "m", "n", "k"),
    [
        ("tensor", 1, 40, 72),
        ("channel", 1, 48, 64),
        ("channel", 7, 33, 100),
        ("channel", 17, 16, 40),
        ("block", 1, 40, 96),
        ("block", 5, 50, 80),
        ("block", 33, 24, 64),
        ("block-2-per-tile", 3, 40, 160),
    ],
)
@PRODUCTS
def test_fp8_weights_match_the_dequantized_matmul(scheme: str, m: int, n: int, k: int, product: dict) -> None:
    generator = torch.Generator().manual_seed(m * n + k)
    # Blocks of 16 x 32 (ragged at N's and K's ends); per channel: one group over K; per tensor:
    # one scale for every row; blocks two to a K tile.
    scale_rows, group_k = {"tensor": (n, k), "channel": (1, k)}.get(scheme, (16, 32))
    q, scale, dense = _fp8(n, k, scale_rows, group_k, generator)
    x = torch.randn(m, k, generator=generator)
    launch = SMALL | {"block_k": 64} if scheme == "block-2-per-tile" else SMALL  # a ragged last tile
    launch = launch | product
    out = skinny_gemm(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), group_k, scale_rows, launch=launch)
    assert out.shape == (m, n) and out.dtype == x.dtype
    _check(out, x, dense)


@pytest.mark.parametrize(
    ("m", "n", "k", "group"),
    [
        (1, 48, 128, 32),
        (3, 40, 128, 64),
        (1, 24, 256, 128),
        (16, 17, 192, 64),
        (33, 32, 64, 32),
        (2, 16, 72, 72),
    ],
)
@PRODUCTS
def test_int4_weights_match_the_dequantized_matmul(m: int, n: int, k: int, group: int, product: dict) -> None:
    generator = torch.Generator().manual_seed(m * n + k)
    q = torch.randint(0, 16, (n, k), generator=generator)
    scales = torch.rand(n, k // group, generator=generator) * 0.1 + 0.01
    zeros = torch.randint(0, 16, (n, k // group), generator=generator).float()
    dense = (q - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
    x = torch.randn(m, k, generator=generator)
    launch = {"block_n": 16, "block_k": 64, "num_stages": 1} | product
    out = skinny_gemm(
        x.to(DEVICE),
        pack_w4a16(q).to(DEVICE),
        scales.to(DEVICE),
        group,
        zeros=zeros.to(DEVICE),
        launch=launch,
    )
    _check(out, x, dense)


def test_scale_groups_sit_whole_inside_a_k_tile() -> None:
    assert group_in_tile(128, 4096, 512) == (128, 512) and group_in_tile(128, 4096, 64) == (128, 128)
    assert group_in_tile(4096, 4096, 256) == (0, 256)  # one group over K: scaled once, at the end
    assert group_in_tile(96, 4096, 256) is None and group_in_tile(4, 64, 256) is None


def test_split_launches_sum_in_one_order_and_leave_their_counters_at_zero() -> None:
    """The split partials' sum has one order (the same bits on every call), and the last program of
    each tile resets its counter, so the next launch (a CUDA graph's replay) starts from zero."""
    from pagedllm.kernels.triton.split_k import arrival_counters

    generator = torch.Generator().manual_seed(7)
    n, k, group = 40, 256, 32
    q = torch.randint(0, 16, (n, k), generator=generator)
    scales = torch.rand(n, k // group, generator=generator) * 0.1 + 0.01
    zeros = torch.randint(0, 16, (n, k // group), generator=generator).float()
    x = torch.randn(3, k, generator=generator).to(DEVICE)
    args = (x, pack_w4a16(q).to(DEVICE), scales.to(DEVICE), group)
    launch = {"block_n": 16, "block_k": 32, "num_stages": 1, "fma": 1, "num_splits": 4}
    first = skinny_gemm(*args, zeros=zeros.to(DEVICE), launch=launch)
    assert torch.equal(skinny_gemm(*args, zeros=zeros.to(DEVICE), launch=launch), first)
    assert not arrival_counters(x.device, 0).any()
    dense = (q - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
    _check(first, x.cpu(), dense)
