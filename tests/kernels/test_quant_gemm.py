"""The quantized-weight GEMMs (kernels/triton/quant_gemm.py) against a naive torch reference:
the weights dequantized in float32, the activations rounded the same way (run on the CPU under
TRITON_INTERPRET=1 at tiny shapes; on CUDA as well when there is one)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.triton.quant_gemm import (
    fp8_block_gemm,
    pack_w4a16,
    quantize_per_token_group,
    w4a16_fits,
    w4a16_gemm,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("m", "n", "k", "group"),
    [(1, 48, 64, 32), (5, 40, 128, 64), (19, 32, 96, 32), (3, 17, 1040, 8), (2, 33, 96, 96)],
)
def test_w4a16_gemm_matches_the_dequantized_matmul(m: int, n: int, k: int, group: int) -> None:
    generator = torch.Generator().manual_seed(m)
    q = torch.randint(0, 16, (n, k), generator=generator)
    scales = torch.rand(n, k // group, generator=generator) * 0.1 + 0.01
    zeros = torch.randint(0, 16, (n, k // group), generator=generator).float()
    x = torch.randn(m, k, generator=generator)
    dense = (q - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
    out = w4a16_gemm(x.to(DEVICE), pack_w4a16(q).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), group)
    torch.testing.assert_close(out.cpu(), x @ dense.t(), atol=1e-4, rtol=1e-4)


def test_w4a16_packing_puts_input_8i_plus_j_in_nibble_j_of_word_i() -> None:
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]])
    assert pack_w4a16(q).tolist() == [[int("F7654321", 16) - 2**32]]


def test_w4a16_takes_groups_of_whole_words_only() -> None:
    assert w4a16_fits(128, 256) and w4a16_fits(32, 96) and w4a16_fits(8, 64) and w4a16_fits(24, 96)
    assert not w4a16_fits(4, 64) and not w4a16_fits(12, 96)


def _block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    bn, bk = block
    n, k = w.shape
    tiles = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn)).unflatten(0, (-1, bn)).unflatten(2, (-1, bk))
    scale = tiles.abs().amax(dim=(1, 3)) / 448
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.flatten(2).flatten(0, 1)[:n, :k].contiguous(), scale


@pytest.mark.parametrize(
    ("m", "n", "k", "block"),
    [
        # 16-wide blocks: the interpreter only (a GPU's FP8 MMA needs K >= 32; layers fall back).
        pytest.param(
            1, 48, 64, (16, 16), marks=pytest.mark.skipif(DEVICE == "cuda", reason="K >= 32 on a GPU")
        ),
        (7, 40, 64, (32, 32)),
        pytest.param(
            18, 24, 32, (16, 16), marks=pytest.mark.skipif(DEVICE == "cuda", reason="K >= 32 on a GPU")
        ),
        (5, 72, 256, (64, 128)),
    ],
)
def test_fp8_block_gemm_matches_the_rounded_matmul(m: int, n: int, k: int, block: tuple[int, int]) -> None:
    generator = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, k, generator=generator), torch.randn(m, k, generator=generator)
    q, scale = _block_quantize(w, block)
    dense = q.float() * scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    groups = x.view(m, -1, block[1])
    x_scale = groups.abs().amax(-1, keepdim=True) / 448
    x_rounded = ((groups / x_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * x_scale).view(m, k)
    out = fp8_block_gemm(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), block)
    torch.testing.assert_close(out.cpu(), x_rounded @ dense.t(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("m", "k", "group"), [(3, 64, 64), (2, 100, 32), (4, 40, 128), (1, 2100, 2100)])
def test_fp8_activation_quantization_is_the_cpu_path_s_bit_for_bit(m: int, k: int, group: int) -> None:
    """Per token (group >= K) or per token group, the last group ragged, a zero row kept zero: the
    scales and e4m3 values of fp8_utils' dynamic rounding, exactly (on a GPU the Triton kernel's;
    on the CPU torch's, tests/gpu checks the kernel against it)."""
    from pagedllm.layers.quantization import fp8_utils

    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3
    x[0] = 0.0
    q, scale = quantize_per_token_group(x.to(DEVICE), group)
    width = min(group, k)
    groups = torch.nn.functional.pad(x, (0, -k % width)).view(m, -1, width)
    expected_scale = fp8_utils.dynamic_scale(groups, -1)
    torch.testing.assert_close(scale.cpu(), expected_scale.squeeze(-1), atol=0, rtol=0)
    expected = (groups / expected_scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, -1)[:, :k]
    assert torch.equal(q.cpu().view(torch.uint8), expected.view(torch.uint8))
