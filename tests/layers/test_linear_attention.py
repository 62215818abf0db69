"""The linear-attention torch references against independent oracles: transformers' token-by-token
gated delta rule (``torch_recurrent_gated_delta_rule``) for Gated DeltaNet's chunked prefill form
and one-step update; transformers' Mamba-2 chunk scan and selective state update for the SSD
forms; a whole-sequence ``F.conv1d`` for the conv window carried across chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.nemotron_h.modeling_nemotron_h import (
    mamba2_chunk_scan,
    mamba2_selective_state_update,
)
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from pagedllm.layers.linear_attention.conv1d import causal_conv1d_prefill, causal_conv1d_update
from pagedllm.layers.linear_attention.gated_delta_rule import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from pagedllm.layers.linear_attention.ssd import ssd_chunk_scan, ssd_step

ATOL = 1e-5


def _inputs(num_tokens: int, num_k_heads: int, num_v_heads: int, dk: int = 8, dv: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_k_heads, dk, generator=gen)
    k = torch.randn(num_tokens, num_k_heads, dk, generator=gen)
    v = torch.randn(num_tokens, num_v_heads, dv, generator=gen)
    g = -torch.rand(num_tokens, num_v_heads, generator=gen)  # log decays, <= 0
    beta = torch.rand(num_tokens, num_v_heads, generator=gen)
    state = torch.randn(num_v_heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def _oracle(q, k, v, g, beta, state):
    out, final = torch_recurrent_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        initial_state=None if state is None else state[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], final[0]


@pytest.mark.parametrize("num_tokens", [1, 7, 16, 37])
@pytest.mark.parametrize("chunk_size", [4, 16, 64])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_rule_matches_token_by_token(num_tokens, chunk_size, heads, with_state) -> None:
    q, k, v, g, beta, state = _inputs(num_tokens, *heads)
    state = state if with_state else None
    expected_out, expected_state = _oracle(q, k, v, g, beta, state)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk_size)
    torch.testing.assert_close(out, expected_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(final, expected_state, atol=ATOL, rtol=0)


def test_state_carried_across_chunked_calls_equals_one_call() -> None:
    """A prompt cut into prefill chunks of any length, the state handed from one to the next."""
    q, k, v, g, beta, _ = _inputs(50, 2, 4)
    expected_out, expected_state = _oracle(q, k, v, g, beta, None)
    state, outs = None, []
    for start, end in [(0, 13), (13, 14), (14, 45), (45, 50)]:
        out, state = chunk_gated_delta_rule(
            q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], state, chunk_size=8
        )
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), expected_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(state, expected_state, atol=ATOL, rtol=0)


def test_one_step_update_over_a_batch_matches_oracle() -> None:
    """Three sequences decoding one token each, from their own states."""
    batch = [_inputs(1, 2, 4, seed=s) for s in range(3)]
    q, k, v, g, beta = (torch.cat([b[i] for b in batch]) for i in range(5))
    states = torch.stack([b[5] for b in batch])
    out, new_states = recurrent_gated_delta_rule(q, k, v, g, beta, states)
    for i, (qi, ki, vi, gi, bi, si) in enumerate(batch):
        expected_out, expected_state = _oracle(qi, ki, vi, gi, bi, si)
        torch.testing.assert_close(out[i], expected_out[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(new_states[i], expected_state, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernel", [2, 4])
def test_conv_window_across_chunks_and_decodes_matches_whole_sequence_conv(kernel: int) -> None:
    gen = torch.Generator().manual_seed(1)
    channels, num_tokens = 5, 23
    x = torch.randn(num_tokens, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    expected = F.silu(
        F.conv1d(x.t()[None], weight[:, None], padding=kernel - 1, groups=channels)[0, :, :num_tokens].t()
    )
    outs, state = [], None
    for start, end in [(0, 1), (1, 9), (9, 18)]:  # prefill chunks, the first a single token
        out, state = causal_conv1d_prefill(x[start:end], weight, None, state)
        outs.append(out)
    for t in range(18, num_tokens):  # then decodes, batched with a sequence at its first token
        batch_x = torch.stack([x[t], x[0]])
        batch_states = torch.stack([state, torch.full_like(state, float("nan"))])
        out, new_states = causal_conv1d_update(
            batch_x, weight, None, batch_states, torch.tensor([True, False])
        )
        torch.testing.assert_close(out[1], expected[0], atol=ATOL, rtol=0)  # a fresh start ignores its slot
        outs.append(out[:1])
        state = new_states[0]
    torch.testing.assert_close(torch.cat(outs), expected, atol=ATOL, rtol=0)


def _ssd_inputs(num_tokens: int, num_heads: int = 4, n_groups: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_heads, 6, generator=gen)
    dt = F.softplus(torch.randn(num_tokens, num_heads, generator=gen))
    A = -2 * torch.rand(num_heads, generator=gen)
    B = torch.randn(num_tokens, n_groups, 5, generator=gen)
    C = torch.randn(num_tokens, n_groups, 5, generator=gen)
    D = torch.randn(num_heads, generator=gen)
    state = torch.randn(num_heads, 6, 5, generator=gen)
    return x, dt, A, B, C, D, state


@pytest.mark.parametrize("num_tokens", [1, 9, 37])
@pytest.mark.parametrize("chunk_size", [4, 16])
@pytest.mark.parametrize("with_state", [False, True])
def test_ssd_chunk_scan_matches_transformers(num_tokens: int, chunk_size: int, with_state: bool) -> None:
    x, dt, A, B, C, D, state = _ssd_inputs(num_tokens)
    state = state if with_state else None
    expected, expected_state = mamba2_chunk_scan(
        x[None],
        dt[None],
        A,
        B[None],
        C[None],
        chunk_size=8,
        D=D,
        initial_states=None if state is None else state[None],
        return_final_states=True,
    )
    y, final = ssd_chunk_scan(x, dt, A, B, C, D, state, chunk_size=chunk_size)
    torch.testing.assert_close(y, expected[0], atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(final, expected_state[0], atol=ATOL, rtol=1e-5)


def test_ssd_step_matches_transformers_selective_state_update() -> None:
    x, dt, A, B, C, D, _ = _ssd_inputs(3)  # three sequences, one token each
    gen = torch.Generator().manual_seed(5)
    state = torch.randn(3, 4, 6, 5, generator=gen)
    expected_state = state.clone()
    heads = lambda t: t[:, :, None].expand(-1, -1, 6)  # noqa: E731 (per head -> per head and dim)
    expected = mamba2_selective_state_update(
        expected_state, x, heads(dt), A[:, None, None].expand(-1, 6, 5), B, C, D[:, None].expand(-1, 6)
    )
    y, new_state = ssd_step(x, dt, A, B, C, D, state)
    torch.testing.assert_close(y, expected, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(new_state, expected_state, atol=ATOL, rtol=1e-5)


def test_gated_deltanet_builds_on_the_meta_device() -> None:
    """The GPU worker sizes a model by building it on the meta device before loading: the
    layer's column map (and its run, computed on the host) must build there too."""
    from pagedllm.layers.linear_attention.gated_deltanet import GatedDeltaNet

    with torch.device("meta"):
        layer = GatedDeltaNet(256, 2, 4, 128, 128, 4, 1e-6)
    assert layer.conv_input_cols.device.type == "meta"
    assert layer.conv_cols_run == 128  # Qwen3-Next's map: whole 128-column runs


@pytest.mark.parametrize(
    ("versions", "usable"),
    [
        ({"fla-core": "0.6.0"}, True),
        ({"flash-linear-attention": "0.7.1"}, True),
        ({"flash-linear-attention": "0.4.1"}, False),  # would read the V-first state transposed
        ({}, False),  # an fla package no distribution claims
    ],
)
def test_fla_is_used_only_at_a_version_that_takes_the_v_first_state(monkeypatch, caplog, versions, usable):
    import importlib.metadata
    import importlib.util

    from pagedllm.layers.linear_attention import mixer

    def version(name: str) -> str:
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "fla" else None)
    monkeypatch.setattr(importlib.metadata, "version", version)
    mixer.fla_installed.cache_clear()
    try:
        assert mixer.fla_installed() is usable
        assert ("older than 0.6" in caplog.text) is not usable
    finally:
        mixer.fla_installed.cache_clear()
