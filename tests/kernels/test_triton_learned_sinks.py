"""Learned sinks (gpt-oss: a logit per head in every softmax's denominator) in the Triton decode
and prefill kernels and the triton backend, against the torch oracle (itself checked against a
dense reference in tests/attention/test_attention_sinks.py).

Runs on the CPU under TRITON_INTERPRET=1 (set by conftest.py when there is no GPU), else on CUDA.
Tiny partitions and tiles, so that a decode's context spans several partitions (the sink must
count once in the merge) and prefill chunks sit behind cached contexts.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the triton attention backend needs the triton package")

from test_triton_attention import DEVICE, Launch, assert_matches, make_batch, run_kernels

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.attention.backends.triton_backend import TritonAttentionBackend

CONTEXT_LENS = [0, 3, 20, 37, 70, 99, 0, 60, 45]
QUERY_LENS = [1] * 6 + [40, 25, 1]
NUM_DECODES = 6


def _learned(num_heads: int) -> torch.Tensor:
    return torch.linspace(-2.0, 3.0, num_heads).to(DEVICE)


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_kernels_match_torch(window: int | None, heads: tuple[int, int]) -> None:
    num_heads, num_kv_heads = heads
    batch = make_batch(
        NUM_DECODES,
        CONTEXT_LENS,
        QUERY_LENS,
        num_heads,
        num_kv_heads,
        64,
        16,
        torch.float32,
        num_padding_tokens=2,
    )
    variants = {"sliding_window": window, "sinks": _learned(num_heads)}
    oracle = TorchAttentionBackend(num_heads, 64, 64**-0.5, num_kv_heads, **variants)
    ref = oracle.forward(batch.query, batch.key, batch.value, batch.torch_caches(), batch.md)
    ref = ref[: int(batch.md.query_start_loc_cpu[-1])]
    out = run_kernels(batch, 64, max_seq_len=160, launch=Launch(), **variants)
    assert_matches(out, ref, torch.float32)
    # The comparison can fail: without the sinks the kernels give another output.
    plain = run_kernels(batch, 64, max_seq_len=160, launch=Launch(), sliding_window=window)
    assert (plain - ref).abs().amax() > 1e-2


def test_backend_forward_with_learned_sinks() -> None:
    """The backend with its own launch table (one partition per decode) and the fused rotary-less
    cache write."""
    batch = make_batch(3, [5, 40, 90, 0, 70], [1, 1, 1, 30, 9], 8, 2, 64, 16, torch.float32)
    learned = _learned(8)
    oracle = TorchAttentionBackend(8, 64, 0.125, 2, sliding_window=32, sinks=learned)
    ref = oracle.forward(batch.query, batch.key, batch.value, batch.torch_caches(), batch.md)
    backend = TritonAttentionBackend(8, 64, 0.125, 2, sliding_window=32, sinks=learned)
    out = backend.forward(batch.query, batch.key, batch.value, (batch.key_cache, batch.value_cache), batch.md)
    assert_matches(out, ref, torch.float32)
