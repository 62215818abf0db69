"""MXFP4 (OCP Microscaling Formats v1.0, "MX" spec, section 5): blocks of 32 FP4 (E2M1) elements
sharing one E8M0 scale, as gpt-oss ships its expert weights.

Storage, as gpt-oss checkpoints hold it: ``<name>_blocks`` ``[..., num_blocks, 16]`` uint8, two
elements a byte, the low nibble first; ``<name>_scales`` ``[..., num_blocks]`` uint8, the shared
exponent with bias 127. Element ``2 * j`` of a block is ``E2M1(byte[j] & 0xF) * 2 ** (scale - 127)``
and element ``2 * j + 1`` the same of ``byte[j] >> 4``; E2M1 is 1 sign, 2 exponent, 1 mantissa bits:
the 16 values below.

Dequantizing to bfloat16 costs 4x the checkpoint's bytes (17 bits against ~4.25 an element).
"""

from __future__ import annotations

import torch

# E2M1 code -> value (OCP MX spec, table 5): sign bit 3, then exponent (bias 1) and mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK_SIZE = 32
# Bytes a block of 32 elements takes: 16 bytes of nibbles and one scale.
MXFP4_BYTES_PER_BLOCK = MXFP4_BLOCK_SIZE // 2 + 1
# Blocks dequantized at a time: ~100 MiB of temporaries.
_CHUNK_BLOCKS = 1 << 18


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks: [..., num_blocks, 16] uint8; scales: [..., num_blocks] uint8 -> [..., num_blocks * 32]
    in ``dtype`` (exact: every MXFP4 value is a float32, and bfloat16, value unless the scale
    leaves bfloat16's range)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != MXFP4_BLOCK_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit: blocks "
            f"must be [..., num_blocks, {MXFP4_BLOCK_SIZE // 2}] and scales [..., num_blocks]"
        )
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(*scales.shape, MXFP4_BLOCK_SIZE, dtype=dtype, device=blocks.device)
    flat_blocks, flat_scales, flat_out = (
        blocks.reshape(-1, 16),
        scales.reshape(-1),
        out.view(-1, MXFP4_BLOCK_SIZE),
    )
    # In chunks: the int64 codes and float32 values of a whole gpt-oss-120b expert tensor would
    # take ~25 GiB of temporaries.
    for start in range(0, flat_scales.shape[0], _CHUNK_BLOCKS):
        chunk = flat_blocks[start : start + _CHUNK_BLOCKS]
        codes = torch.stack((chunk & 0x0F, chunk >> 4), dim=-1).flatten(-2).long()  # [n, 32]
        exponents = flat_scales[start : start + _CHUNK_BLOCKS].to(torch.int32)[:, None] - 127
        flat_out[start : start + _CHUNK_BLOCKS] = torch.ldexp(lut[codes], exponents)
    return out.flatten(-2)
