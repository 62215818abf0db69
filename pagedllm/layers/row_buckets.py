"""Row counts bucketed for oneDNN, which builds and caches a primitive per input shape.

oneDNN (behind ``mkldnn._linear_pointwise`` and torch's bf16 ``mm`` on the CPU) builds a primitive
for each input shape it sees: JIT kernels, 2-16 ms to build on 2 cores and 0.1-0.5 MB kept, for
each weight shape and row count. It keeps the last 1,024 in an LRU cache
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``; ideep keeps a second, ``LRU_CACHE_CAPACITY``). A step has any
token count up to ``max_num_batched_tokens``: with five weight shapes, ~10,000 primitives for
2,048 tokens, so nearly every prefill step built new ones, and the caches grew by hundreds of MB
until full (benchmarks/RESULTS.md, "Soak"). With the rows padded to buckets, a model with W weight
shapes uses at most W x (16 + 8 x (log2(max_tokens) - 4)) primitives (360 for five shapes up to
2,048 tokens), which the caches hold without evicting: built once, then reused. Rows are
independent in a matrix product: the padding rows (zeros) enter no real row's sums, and their
outputs are sliced off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Row counts taken as they are (decode batches of a few streams); above, 8 buckets per doubling.
EXACT_ROWS = 16
BUCKETS_PER_DOUBLING = 8


def padded_rows(rows: int) -> int:
    """``rows`` up to ``EXACT_ROWS``; above, the next multiple of 1/8 of the power of two below it
    (17 -> 18, 129 -> 144, 1,025 -> 1,152): at most 12.5% padding rows."""
    if rows <= EXACT_ROWS:
        return rows
    step = (1 << ((rows - 1).bit_length() - 1)) // BUCKETS_PER_DOUBLING
    return -(-rows // step) * step


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, K] with zero rows appended up to ``padded_rows(rows)`` (x itself when none are)."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    return x if padded == rows else F.pad(x, (0, 0, 0, padded - rows))
