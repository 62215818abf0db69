"""Mamba-2's decode kernel (kernels/triton/ssd.py) against the torch reference (``ssd_step``), on
the GPU or in Triton's interpreter: state rows read and written in place at scattered slots, a
fresh sequence reading zeros whatever its row holds (NaN here), the scratch row (-1), groups of B
and C shared by several heads, x, B and C read as views of the conv's output, head_dim and
d_state that are not powers of two, and the state in the model's dtype or float32; then the
Mamba-2 layer's decode step on the kernels against its torch path."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import GraniteMoeHybridConfig, NemotronHConfig

from pagedllm.attention.forward_context import set_forward_context
from pagedllm.kernels.triton.ssd import ssd_state_update
from pagedllm.layers.linear_attention.mamba2 import Mamba2Mixer, Mamba2Spec
from pagedllm.layers.linear_attention.ssd import ssd_step
from tests.kernels.test_gated_deltanet_paths import step_metadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS = [3, 0, -1, 5]  # scattered rows, and the scratch row
HAS_STATE = [True, False, True, True]  # the second sequence is at its first token


# (activations, state): the state in the model's dtype, or float32 (mamba_ssm_cache_dtype).
@pytest.mark.parametrize(
    ("dtype", "state_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize(
    ("num_heads", "n_groups", "head_dim", "d_state"), [(4, 2, 16, 32), (6, 3, 24, 20), (2, 1, 64, 128)]
)
def test_ssd_state_update_matches_reference(
    dtype, state_dtype, num_heads, n_groups, head_dim, d_state
) -> None:
    gen = torch.Generator().manual_seed(0)
    batch = len(SLOTS)
    d_inner, group_dim = num_heads * head_dim, n_groups * d_state
    conv_out = torch.randn(batch, d_inner + 2 * group_dim, generator=gen).to(dtype).to(DEVICE)
    x, B, C = conv_out.split([d_inner, group_dim, group_dim], dim=-1)
    x = x.view(batch, num_heads, head_dim)
    B, C = B.view(batch, n_groups, d_state), C.view(batch, n_groups, d_state)
    # dt as the layer computes it (softplus, in float32), a column view of a wider tensor.
    dt = torch.nn.functional.softplus(torch.randn(batch, 2 * num_heads, generator=gen))[:, ::2].to(DEVICE)
    A_log = torch.randn(num_heads, generator=gen).to(DEVICE)
    D = torch.randn(num_heads, generator=gen).to(DEVICE)
    state = torch.randn(7, num_heads, head_dim, d_state, generator=gen).to(state_dtype)
    state[0] = float("nan")  # the fresh sequence's row: must not be read
    state = state.to(DEVICE)
    slots = torch.tensor(SLOTS, device=DEVICE)
    has_state = torch.tensor(HAS_STATE, device=DEVICE)
    start = torch.where(has_state[:, None, None, None], state[slots].float(), 0.0)
    expected, expected_state = ssd_step(x, dt, -torch.exp(A_log), B, C, D, start)
    untouched = state[[1, 2, 4]].clone()
    out = ssd_state_update(x, B, C, dt, A_log, D, state, slots, has_state)
    assert out.dtype == dtype and out.shape == (batch, num_heads, head_dim)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), expected, **tol)
    torch.testing.assert_close(state[slots].float(), expected_state.to(state_dtype).float(), **tol)
    assert torch.equal(state[[1, 2, 4]], untouched)  # rows of no sequence in the batch


def test_ssd_state_update_with_no_sequences() -> None:
    state = torch.zeros(2, 2, 4, 8, device=DEVICE)
    empty = torch.empty(0, 2, 4, device=DEVICE)
    groups = torch.empty(0, 1, 8, device=DEVICE)
    out = ssd_state_update(
        empty, groups, groups, torch.empty(0, 2, device=DEVICE), torch.zeros(2, device=DEVICE),
        torch.zeros(2, device=DEVICE), state, torch.empty(0, dtype=torch.int64, device=DEVICE),
        torch.empty(0, dtype=torch.bool, device=DEVICE),
    )  # fmt: skip
    assert out.shape == (0, 2, 4) and torch.equal(state, torch.zeros_like(state))


# Both families' field names: Nemotron-H's, and Granite 4.0-H's (Bamba's) with its conv bias, its
# time-step limits and chunks of 16.
SPECS = {
    "nemotron-h": lambda: Mamba2Spec.from_nemotron_h(
        NemotronHConfig(
            hidden_size=48, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=24,
            conv_kernel=4, chunk_size=8, num_hidden_layers=1,
        )
    ),
    "granite-4.0-h": lambda: Mamba2Spec.from_granite(
        GraniteMoeHybridConfig(
            hidden_size=48, mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
            mamba_chunk_size=16, num_hidden_layers=1, layer_types=["mamba"],
        )
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", list(SPECS))
def test_the_mamba2_layer_decodes_on_the_kernels_as_on_its_torch_path(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mamba2Mixer bound to a Triton platform chooses the fused decode step (the conv's and the
    SSD's kernels); in a step of three decodes (one fresh, one on the scratch row) and a prefill
    chunk, it computes what its torch path does: output, conv windows and states."""
    from pagedllm.layers import custom_op

    spec = SPECS[family]()
    platform = custom_op.platform_for(torch.device(DEVICE))
    with monkeypatch.context() as patch:
        patch.setattr(custom_op, "platform_for", lambda device: dataclasses.replace(platform, triton=True))
        on_kernels = Mamba2Mixer(spec).to(DEVICE)
    assert on_kernels.forward_method == on_kernels._decode_triton
    on_torch = copy.deepcopy(on_kernels)
    on_torch.forward_method, on_torch.conv_prefill = on_torch._decode_torch, on_torch._conv_prefill_torch
    params = torch.Generator().manual_seed(3)
    for a, b in zip(on_kernels.parameters(), on_torch.parameters(), strict=True):
        a.data.copy_(torch.randn(a.shape, generator=params) / 4)
        b.data.copy_(a.data)
    conv_state = torch.randn(
        6, *on_kernels.state_shape.conv_shape, generator=torch.Generator().manual_seed(4)
    )
    ssm_state = torch.randn(6, *on_kernels.state_shape.ssm_shape, generator=torch.Generator().manual_seed(5))
    conv_state[0] = ssm_state[0] = float("nan")  # the fresh sequence's row
    for layer in (on_kernels, on_torch):
        layer.bind_state(conv_state.clone().to(DEVICE), ssm_state.clone().to(DEVICE))
    md = step_metadata([(1, 5, 2), (1, 1, 0), (1, 9, -1), (7, 7, 4)], num_decodes=3)
    hidden = torch.randn(10, spec.hidden_size, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    with set_forward_context(md), torch.no_grad():
        out, expected = on_kernels(hidden), on_torch(hidden)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for name in ("conv_state", "ssm_state"):
        rows = [2, 0, -1, 4]
        torch.testing.assert_close(
            getattr(on_kernels, name)[rows], getattr(on_torch, name)[rows], atol=1e-5, rtol=1e-5
        )
