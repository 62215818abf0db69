"""The gated delta rule's decode kernel (kernels/triton/linear_attention.py) against the torch
reference (layers/linear_attention/), on the GPU or in Triton's interpreter: state rows read and
written in place at scattered slots, fresh sequences reading zeros whatever their row holds, the
scratch row (-1), grouped value heads, and d_k / d_v that are not powers of two (the conv
kernels' tests are in test_causal_conv1d.py)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.triton.linear_attention import gated_delta_rule_update
from pagedllm.layers.linear_attention.gated_delta_rule import recurrent_gated_delta_rule

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS = [3, 0, -1, 5]  # scattered rows, and the scratch row
HAS_STATE = [True, False, True, True]  # the second sequence is at its first token


def _rows(num_rows: int, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    state = torch.randn(num_rows, *shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    state[0] = float("nan")  # the fresh sequence's row: must not be read
    return state.to(DEVICE)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_k_heads", "num_v_heads", "d_k", "d_v"), [(2, 2, 16, 16), (2, 4, 24, 40), (1, 3, 8, 128)]
)
def test_gated_delta_rule_update_matches_reference(state_dtype, num_k_heads, num_v_heads, d_k, d_v) -> None:
    gen = torch.Generator().manual_seed(0)
    batch = len(SLOTS)
    # q, k, v as views of one conv output row per sequence, as the layer passes them.
    conv_out = torch.randn(batch, 2 * num_k_heads * d_k + num_v_heads * d_v, generator=gen).to(DEVICE)
    q, k, v = conv_out.split([num_k_heads * d_k, num_k_heads * d_k, num_v_heads * d_v], dim=-1)
    q, k = q.view(batch, num_k_heads, d_k), k.view(batch, num_k_heads, d_k)
    v = v.view(batch, num_v_heads, d_v)
    g = -torch.rand(batch, num_v_heads, generator=gen).to(DEVICE)
    beta = torch.rand(batch, num_v_heads, generator=gen).to(DEVICE)
    state = _rows(7, num_v_heads, d_k, d_v, dtype=state_dtype)
    slots = torch.tensor(SLOTS, device=DEVICE)
    has_state = torch.tensor(HAS_STATE, device=DEVICE)
    start = torch.where(has_state[:, None, None, None], state[slots].float(), 0.0)
    expected, expected_state = recurrent_gated_delta_rule(q, k, v, g, beta, start)
    out = gated_delta_rule_update(q, k, v, g, beta, state, slots, has_state)
    tol = dict(atol=1e-4, rtol=1e-4) if state_dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out, expected, **tol)
    torch.testing.assert_close(state[slots].float(), expected_state.to(state_dtype).float(), **tol)
