"""The gated delta rule's decode kernel and the output norm (kernels/triton/linear_attention.py)
against the torch references (layers/linear_attention/), on the GPU or in Triton's interpreter:
state rows read and written in place at scattered slots, fresh sequences reading zeros whatever
their row holds, the scratch row (-1), grouped value heads, gates read from strided views, and
d_k / d_v that are not powers of two; the output norm writing a step's parts into their rows of
one output; the prefill's in-place l2 normalisation (the conv kernels' tests are in
test_causal_conv1d.py)."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.kernels.triton.linear_attention import gated_delta_rule_update, l2_normalize_, rms_norm_gated
from pagedllm.layers.linear_attention.gated_delta_rule import (
    gdn_gates,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from pagedllm.layers.linear_attention.gated_deltanet import RMSNormGated
from pagedllm.layers.linear_attention.mixer import norm_into

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS = [3, 0, -1, 5]  # scattered rows, and the scratch row
HAS_STATE = [True, False, True, True]  # the second sequence is at its first token


def _rows(num_rows: int, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    state = torch.randn(num_rows, *shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    state[0] = float("nan")  # the fresh sequence's row: must not be read
    return state.to(DEVICE)


def _gate_views(batch: int, num_k_heads: int, group: int, dtype: torch.dtype, gen: torch.Generator):
    """b and a as Qwen3-Next's in_proj_ba output lays them out: [b (group) | a (group)] per key
    head, so each is a strided [batch, num_k_heads, group] view."""
    ba = (2 * torch.randn(batch, num_k_heads, 2 * group, generator=gen)).to(dtype).to(DEVICE)
    return ba.split([group, group], dim=-1)


# (activations, state): the state in the model's dtype, or float32 (mamba_ssm_cache_dtype).
@pytest.mark.parametrize(
    ("dtype", "state_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize(
    ("num_k_heads", "num_v_heads", "d_k", "d_v"), [(2, 2, 16, 16), (2, 4, 24, 40), (1, 3, 8, 128)]
)
def test_gated_delta_rule_update_matches_reference(
    dtype, state_dtype, num_k_heads, num_v_heads, d_k, d_v
) -> None:
    gen = torch.Generator().manual_seed(0)
    batch = len(SLOTS)
    # q, k, v as views of one conv output row per sequence, as the layer passes them.
    conv_out = (
        torch.randn(batch, 2 * num_k_heads * d_k + num_v_heads * d_v, generator=gen).to(dtype).to(DEVICE)
    )
    q, k, v = conv_out.split([num_k_heads * d_k, num_k_heads * d_k, num_v_heads * d_v], dim=-1)
    q, k = q.view(batch, num_k_heads, d_k), k.view(batch, num_k_heads, d_k)
    v = v.view(batch, num_v_heads, d_v)
    b, a = _gate_views(batch, num_k_heads, num_v_heads // num_k_heads, dtype, gen)
    A_log = torch.randn(num_v_heads, generator=gen).to(DEVICE)
    dt_bias = torch.randn(num_v_heads, generator=gen).to(DEVICE)
    state = _rows(7, num_v_heads, d_v, d_k, dtype=state_dtype)  # V-first: [d_v, d_k] per head
    slots = torch.tensor(SLOTS, device=DEVICE)
    has_state = torch.tensor(HAS_STATE, device=DEVICE)
    start = torch.where(has_state[:, None, None, None], state[slots].float(), 0.0)
    g, beta = gdn_gates(a.flatten(1), b.flatten(1), A_log, dt_bias)
    # The reference holds S as [d_k, d_v].
    expected, expected_state = recurrent_gated_delta_rule(q, k, v, g, beta, start.transpose(-1, -2))
    expected_state = expected_state.transpose(-1, -2)
    out = gated_delta_rule_update(q, k, v, a, b, A_log, dt_bias, state, slots, has_state)
    assert out.dtype == dtype
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), expected, **tol)
    assert state.dtype == state_dtype
    torch.testing.assert_close(state[slots].float(), expected_state.to(state_dtype).float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_tokens", "num_k_heads", "group", "d_v"), [(5, 2, 2, 16), (3, 1, 3, 40), (1, 4, 1, 128)]
)
def test_rms_norm_gated_matches_reference(dtype, num_tokens, num_k_heads, group, d_v) -> None:
    """The output norm against the layer's torch path, the gate read as a strided view of a
    fused projection's output ([q | k | v | z] per key head, here with room for q, k, v)."""
    gen = torch.Generator().manual_seed(0)
    num_v_heads = num_k_heads * group
    x = torch.randn(num_tokens, num_v_heads, d_v, generator=gen).to(dtype).to(DEVICE)
    fused = torch.randn(num_tokens, num_k_heads, 3 * group * d_v, generator=gen).to(dtype).to(DEVICE)
    gate = fused[..., 2 * group * d_v :].unflatten(-1, (group, d_v))
    with torch.device(DEVICE):
        norm = RMSNormGated(d_v, 1e-6).to(dtype)
    norm.weight.copy_(torch.randn(d_v, generator=gen))
    expected = norm.forward_torch(x, gate)
    out = rms_norm_gated(x, gate, norm.weight, norm.eps)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        # The torch path's roundings, in its order. Triton's interpreter truncates float32 to
        # bfloat16 where a GPU rounds to nearest: up to one ulp for each of the three roundings
        # there; on a GPU within one ulp (the sum of squares' order).
        ulps = 3 if os.environ.get("TRITON_INTERPRET") == "1" else 1
        torch.testing.assert_close(out, expected, atol=0, rtol=ulps * 2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "part_lengths", [(9,), (3, 6), (1, 13)]
)  # one kind of sequence; decodes and prefills
@pytest.mark.parametrize("kernel", [False, True])
def test_norm_writes_each_part_into_its_rows(dtype, part_lengths, kernel) -> None:
    """The recurrence's parts (a step's decodes, its prefill chunks) normed into their rows of one
    output (``norm_into``), by the kernel and by the torch path: each part's rows as one norm over
    the whole batch gives them, bit for bit (rows are independent), and nothing written outside
    the output's rows."""
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_k_heads, group, d_v = sum(part_lengths), 2, 2, 24
    num_v_heads = num_k_heads * group
    fused = torch.randn(num_tokens, num_k_heads, 3 * group * d_v, generator=gen).to(dtype).to(DEVICE)
    gate = fused[..., 2 * group * d_v :].unflatten(-1, (group, d_v))
    x = torch.randn(num_tokens, num_v_heads, d_v, generator=gen).to(dtype).to(DEVICE)
    with torch.device(DEVICE):
        norm = RMSNormGated(d_v, 1e-6).to(dtype)
    norm.weight.copy_(torch.randn(d_v, generator=gen))
    norm.forward_method = norm.forward_triton if kernel else norm.forward_torch
    whole = norm(x, gate)
    # The output as rows 1..num_tokens of a larger buffer: the rows around it must stay NaN.
    buffer = torch.full((num_tokens + 2, num_v_heads * d_v), float("nan"), dtype=dtype, device=DEVICE)
    out = buffer[1 : num_tokens + 1]
    assert norm_into(norm, list(x.split(part_lengths)), gate, out) is out
    assert torch.equal(out, whole)
    assert buffer[0].isnan().all() and buffer[-1].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 128), (37, 3, 128), (5, 2, 40), (130, 16, 24)])
def test_l2_normalize_in_place_matches_reference(dtype, shape) -> None:
    """Rows of any count and width (a partial last block, a width no power of two), written back
    into the tensor: the torch reference in float32, rounded once."""
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)
    x[0, 0] = 0.0  # a zero row stays zero (eps), never NaN
    expected = l2_normalize(x.float()).to(dtype)
    out = l2_normalize_(x)
    assert out.data_ptr() == x.data_ptr()
    assert not torch.isnan(x).any()
    if dtype == torch.float32:
        torch.testing.assert_close(x, expected, atol=1e-6, rtol=1e-6)
    else:
        # One rounding: within one ulp (two under the interpreter, which truncates).
        ulps = 2 if os.environ.get("TRITON_INTERPRET") == "1" else 1
        torch.testing.assert_close(x, expected, atol=0, rtol=ulps * 2**-7)
