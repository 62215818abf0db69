"""paged_decode's query groups compiled for the GPU, at the engine's launches and real models' head
counts, bf16: against the float64 reference, against the launch without groups, and replayed from
a CUDA graph over other groups than it was captured with (tests/kernels/test_decode_query_groups.py
runs the same logic under the interpreter at tiny tiles)."""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton kernels", allow_module_level=True)

from pagedllm.kernels.triton import paged_decode
from pagedllm.kernels.triton.launch import default_launches
from tests.kernels.test_decode_query_groups import make_groups, reference

# Groups across the 512- and 1,024-token partition boundaries, a lone decode, cut drafts.
REQUESTS = [(0, 4), (509, 4), (1021, 3), (2000, 4), (77, 1), (1500, 2), (1023, 4)]
MAX_MODEL_LEN = 4096


def _launch(g, out, partition_size, grouped):
    launch = {
        **asdict(default_launches(g.query.shape[-1], g.query.dtype)[0]),
        "partition_size": partition_size,
    }
    groups = {"query_lens": g.query_lens, "max_query_len": 4} if grouped else {}
    paged_decode(
        g.query, g.key_cache, g.value_cache, g.block_tables, g.seq_lens, g.query.shape[-1] ** -0.5,
        MAX_MODEL_LEN, out, **launch, **groups,
    )  # fmt: skip
    return out


# (query heads, KV heads): Llama-3.1-8B (16-row tiles), Qwen3-0.6B (8 rows padded to 16),
# Llama-3.1-70B (32 rows).
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 8), (16, 8), (64, 8)])
@pytest.mark.parametrize("partition_size", [512, 4096])
def test_query_groups_on_the_gpu(num_heads, num_kv_heads, partition_size):
    g = make_groups(REQUESTS, num_heads, num_kv_heads, 128, 16, torch.bfloat16, num_padding=5)
    grouped = _launch(g, torch.full_like(g.query, float("nan")), partition_size, True)
    plain = _launch(g, torch.full_like(g.query, float("nan")), partition_size, False)
    real = slice(0, g.num_real)
    assert not grouped[real].isnan().any()
    expected = reference(g, 128**-0.5)
    torch.testing.assert_close(grouped[real].double().cpu(), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grouped[real], plain[real], atol=1e-2, rtol=1e-2)


def test_a_captured_launch_replays_other_groups():
    """A graph captured over one grouping (all lone decodes, as the runner's capture dummies) and
    replayed over the step's groups gives the eager launch's output."""
    g = make_groups(REQUESTS, 32, 8, 128, 16, torch.bfloat16)
    step_lens, step_query_lens = g.seq_lens.clone(), g.query_lens.clone()
    g.seq_lens.fill_(1)
    g.query_lens.fill_(1)
    out = torch.empty_like(g.query)
    _launch(g, out, 512, True)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _launch(g, out, 512, True)
    g.seq_lens.copy_(step_lens)
    g.query_lens.copy_(step_query_lens)
    graph.replay()
    eager = _launch(g, torch.empty_like(out), 512, True)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
