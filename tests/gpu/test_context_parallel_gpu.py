"""Context-parallel Triton attention at real sizes on the GPU: the P ranks' ``forward_partial``
over their stripes of the KV cache, merged by log-sum-exp, equal the unsplit ``forward`` (head 128,
bf16, contexts up to 16,384, the engine's own launches), and a float64 reference of one rank."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the triton attention backend needs the triton package")

from pagedllm.attention.backends.triton_backend import TritonAttentionBackend
from tests.kernels import cp_attention_inputs as cp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
SHAPE = (NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE)
SCALE = HEAD_SIZE**-0.5
CUDA = torch.device("cuda")
# bf16 against bf16 (both round P before P @ V, at different split points) and against float64.
ATOL = RTOL = 2e-2


def long_sequences(seed: int = 0) -> cp.Sequences:
    """Three decodes (16,383, 4,095 and 777 cached tokens) and two prefill chunks: 512 tokens after
    15,872 cached, and a fresh 300-token prompt."""
    return cp.make_sequences(3, [16383, 4095, 777, 15872, 0], [1, 1, 1, 512, 300], SHAPE, seed)


def layer(cp_rank: int, cp_world_size: int, **variants: object) -> TritonAttentionBackend:
    return TritonAttentionBackend(
        NUM_HEADS, HEAD_SIZE, SCALE, NUM_KV_HEADS, cp_rank=cp_rank, cp_world_size=cp_world_size, **variants
    )


@pytest.mark.parametrize("variants", [{}, {"sliding_window": 4096}], ids=["full", "window4096"])
@pytest.mark.parametrize("cp_world_size", [2, 4])
def test_merged_partials_equal_unsplit_forward_at_16k(cp_world_size: int, variants: dict) -> None:
    seqs = long_sequences()
    num_tokens = seqs.query.shape[0]
    outs, lses = [], []
    for rank in range(cp_world_size):
        step = cp.rank_step(seqs, rank, cp_world_size, BLOCK_SIZE, torch.bfloat16, CUDA)
        out, lse = layer(rank, cp_world_size, **variants).forward_partial(
            step.query, step.key, step.value, step.kv_cache, step.md
        )
        outs.append(out[:num_tokens])
        lses.append(lse[:num_tokens])
    merged, _ = cp.merge_partials(outs, lses)
    step = cp.rank_step(seqs, 0, 1, BLOCK_SIZE, torch.bfloat16, CUDA)
    unsplit = layer(0, 1, **variants).forward(step.query, step.key, step.value, step.kv_cache, step.md)
    torch.testing.assert_close(merged.float(), unsplit[:num_tokens].float(), atol=ATOL, rtol=RTOL)


def test_one_rank_matches_the_float64_reference_at_16k() -> None:
    # Fewer query tokens than long_sequences: the reference loops over them on the host.
    seqs = cp.make_sequences(2, [16383, 777, 15000], [1, 1, 64], SHAPE, seed=1)
    rounded = seqs.rounded(torch.bfloat16)
    step = cp.rank_step(seqs, 1, 2, BLOCK_SIZE, torch.bfloat16, CUDA)
    out, lse = layer(1, 2).forward_partial(step.query, step.key, step.value, step.kv_cache, step.md)
    ref_out, ref_lse = cp.reference_partial(rounded, (1, 2), SCALE)
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=ATOL, rtol=RTOL)
