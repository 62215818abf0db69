"""The token bitmask: one bit per vocabulary token and row, set when the row may sample it.

Layout (llguidance's, so its matchers fill it directly): int32 ``[num_rows, ceil(vocab_size / 32)]``;
token ``t`` of row ``r`` is allowed iff ``(bitmask[r, t // 32] >> (t % 32)) & 1``. A row of all
ones (-1) leaves its logits alone. 32x smaller than a boolean mask, so the host-to-device copy of a
batch's mask is ``num_rows * vocab_size / 8`` bytes (6 KiB per row at a 49,152-token vocabulary).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import numpy as np
import torch

from pagedllm.platform import platform_for

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    """A bitmask row's width in int32 words."""
    return -(-vocab_size // BITS_PER_WORD)


def allocate_token_bitmask(num_rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """An all-allowed bitmask [num_rows, ceil(vocab_size / 32)] (int32) on the host."""
    bitmask = torch.empty((num_rows, bitmask_words(vocab_size)), dtype=torch.int32, pin_memory=pin_memory)
    # Filled through numpy, on this thread: torch's fill would wake its OpenMP pool.
    bitmask.numpy().fill(-1)
    return bitmask


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place, on the logits' device.

    Args:
        logits: [num_rows, vocab_size] (float).
        bitmask: [num_rows, ceil(vocab_size / 32)] int32, on any device (copied without a sync).
    """
    token_bitmask_applier(logits.device)(logits, bitmask)


def token_bitmask_applier(device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``apply_token_bitmask`` for logits on ``device``, its implementation chosen here, once (a
    sampler keeps it): Triton's pass on CUDA, one numpy unpacking on a little-endian CPU, else
    torch's elementwise ops."""
    if platform_for(device).triton:
        from pagedllm.kernels.triton.sampling import apply_token_bitmask as apply_on_gpu

        return functools.partial(_apply, apply_on_gpu)
    if device.type == "cpu" and sys.byteorder == "little":
        return functools.partial(_apply, _apply_by_unpacking)
    return functools.partial(_apply, _apply_with_torch)


def _apply(
    apply: Callable[[torch.Tensor, torch.Tensor], None], logits: torch.Tensor, bitmask: torch.Tensor
) -> None:
    num_rows, vocab_size = logits.shape
    if bitmask.shape != (num_rows, bitmask_words(vocab_size)) or bitmask.dtype != torch.int32:
        raise ValueError(
            f"bitmask must be int32 [{num_rows}, ceil({vocab_size} / 32)], "
            f"got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    apply(logits, bitmask.to(logits.device, non_blocking=True))


def _apply_by_unpacking(logits: torch.Tensor, words: torch.Tensor) -> None:
    # The words' bytes, least significant first, unpacked least significant bit first: bit i of
    # word w is token 32 * w + i. One numpy pass, a third of the elementwise ops' time.
    bits = np.unpackbits(words.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
    bits = bits[:, : logits.shape[1]]
    logits.masked_fill_(torch.from_numpy(bits) == 0, float("-inf"))


def _apply_with_torch(logits: torch.Tensor, words: torch.Tensor) -> None:
    shifts = torch.arange(BITS_PER_WORD, device=logits.device, dtype=torch.int32)
    # [num_rows, num_words, 32] -> [num_rows, num_words * 32]: bit i of word w is token 32 * w + i.
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[1]]
    logits.masked_fill_(~allowed, float("-inf"))
