"""Gated DeltaNet's Triton step against its torch step, on one layer: decodes and prefill chunks in
one batch (fresh sequences whose rows hold NaN, continued ones, the scratch row), for Qwen3-Next's
fused projections (the conv reads its channels through a column map) and Qwen3.5's split ones.
The Triton path (the conv kernels, the fused delta-rule step with its gates, the gated norm) runs
under Triton's interpreter without a GPU, with the torch chunked rule for the prefill recurrence;
on CUDA with flash-linear-attention installed, with fla's varlen rule. The fla prefill's own code
(its state rows gathered for fla and scattered back) also runs anywhere against a stand-in for fla
that keeps fla's state layout and computes with the torch reference."""

from __future__ import annotations

import sys
import types
from itertools import pairwise

import pytest
import torch

from pagedllm.attention.forward_context import set_forward_context
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.layers.linear_attention.gated_delta_rule import chunk_gated_delta_rule
from pagedllm.layers.linear_attention.gated_deltanet import GatedDeltaNet
from pagedllm.layers.linear_attention.mixer import fla_installed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (new tokens, context after the step, state row): two decodes (one fresh), three prefill chunks
# (a fresh one longer than the conv window, a continued one of one token, a continued one).
BATCH = [(1, 9, 3), (1, 1, 0), (13, 13, 5), (1, 6, -1), (6, 20, 2)]
NUM_ROWS = 7


def step_metadata(batch: list[tuple[int, int, int]], num_decodes: int) -> AttentionMetadata:
    """A stateful layer's step: (new tokens, context after the step, state row) per sequence, the
    ``num_decodes`` decodes first (the KV fields unused)."""
    lengths = [n for n, _, _ in batch]
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([c for _, c, _ in batch], dtype=torch.int32)
    return AttentionMetadata(
        num_decodes=num_decodes,
        num_prefills=len(batch) - num_decodes,
        slot_mapping=torch.zeros(sum(lengths), dtype=torch.int64, device=DEVICE),
        query_start_loc=starts.to(DEVICE),
        seq_lens=seq_lens.to(DEVICE),
        block_tables=torch.zeros(len(batch), 1, dtype=torch.int32, device=DEVICE),
        max_query_len=max(lengths),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
        state_slots=torch.tensor([s for _, _, s in batch], device=DEVICE),
    )


def _metadata() -> AttentionMetadata:
    return step_metadata(BATCH, num_decodes=2)


def _torch_paths(layer: GatedDeltaNet) -> None:
    layer.forward_method = layer._decode_torch
    layer.conv_prefill = layer._conv_prefill_torch
    layer.prefill_method = layer._prefill_torch
    layer.norm.forward_method = layer.norm.forward_torch


def _triton_paths(layer: GatedDeltaNet) -> None:
    layer.forward_method = layer._decode_triton
    layer.conv_prefill = layer._conv_prefill_triton
    layer.prefill_method = (
        layer._prefill_fla if DEVICE == "cuda" and fla_installed() else layer._prefill_torch
    )
    layer.norm.forward_method = layer.norm.forward_triton


def _fla_stand_in(
    q, k, v, g, beta, initial_state, output_final_state, state_v_first, cu_seqlens, cu_seqlens_cpu,
    chunk_indices, chunk_size,
):  # fmt: skip
    """flash-linear-attention 0.6's varlen ``chunk_gated_delta_rule`` as its source lays out its
    states (ops/gated_delta_rule/chunk.py, ops/common/chunk_delta_h.py): ``initial_state`` [N,
    HV, V, K] with ``state_v_first``, contiguous, any dtype (converted to float32 as loaded); the
    final state float32 in the same layout; o in q's dtype. Computed by the torch reference, a
    sequence at a time."""
    assert state_v_first and output_final_state and initial_state.is_contiguous()
    num_seqs, num_v_heads, d_v, d_k = len(cu_seqlens) - 1, v.shape[2], v.shape[3], k.shape[3]
    assert initial_state.shape == (num_seqs, num_v_heads, d_v, d_k), initial_state.shape
    outs, finals = [], []
    for i, (start, end) in enumerate(pairwise(cu_seqlens_cpu.tolist())):
        tokens = slice(start, end)
        out, final = chunk_gated_delta_rule(
            q[0, tokens], k[0, tokens], v[0, tokens], g[0, tokens], beta[0, tokens],
            initial_state[i].float().transpose(-1, -2), chunk_size,
        )  # fmt: skip
        outs.append(out)
        finals.append(final.transpose(-1, -2))
    return torch.cat(outs)[None].to(q.dtype), torch.stack(finals).contiguous()


def _install_fla_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two names ``GatedDeltaNet._prefill_fla`` imports from fla, as the stand-in."""
    names = {
        "fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": _fla_stand_in},
        "fla.ops.utils.index": {"prepare_chunk_indices": lambda *args, **kwargs: None},
    }
    for package in ("fla", "fla.ops", "fla.ops.utils"):
        monkeypatch.setitem(sys.modules, package, types.ModuleType(package))
    for name, attributes in names.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("split_projections", [False, True])
@pytest.mark.parametrize("num_v_heads", [2, 4])  # one or two value heads per key head
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_step_matches_torch_step(
    split_projections: bool, num_v_heads: int, dtype: torch.dtype
) -> None:
    _compare_paths(split_projections, num_v_heads, dtype, _triton_paths)


@pytest.mark.parametrize("num_v_heads", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_prefill_reads_and_writes_the_state_rows_as_fla_lays_them_out(
    monkeypatch: pytest.MonkeyPatch, num_v_heads: int, dtype: torch.dtype
) -> None:
    """The fla prefill's own code (q and k normalised in place, the state rows gathered for fla
    and its final states scattered back, by the Triton kernels) with a stand-in for fla that
    computes with the torch reference: the same outputs and state rows as the torch step."""
    _install_fla_stand_in(monkeypatch)

    def fla_paths(layer: GatedDeltaNet) -> None:
        _triton_paths(layer)
        layer.prefill_method = layer._prefill_fla

    _compare_paths(False, num_v_heads, dtype, fla_paths, with_fla=False)


def _compare_paths(
    split_projections: bool,
    num_v_heads: int,
    dtype: torch.dtype,
    choose_kernels,
    with_fla: bool = DEVICE == "cuda" and fla_installed(),
) -> None:
    """One step of the layer on its torch paths and on ``choose_kernels``'s; ``with_fla``: fla's
    own prefill runs (its products are in lower precision than the reference's)."""
    torch.manual_seed(0)
    with torch.device(DEVICE):
        layer = GatedDeltaNet(64, 2, num_v_heads, 16, 8, 4, 1e-6, split_projections=split_projections)
        for param in layer.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
        layer = layer.to(dtype)
        conv_state = torch.randn(NUM_ROWS, *layer.state_shape.conv_shape, dtype=dtype)
        ssm_state = torch.randn(NUM_ROWS, *layer.state_shape.ssm_shape, dtype=dtype)
        for fresh in (0, 5):  # the fresh sequences' rows: never read
            conv_state[fresh], ssm_state[fresh] = float("nan"), float("nan")
        hidden = torch.randn(sum(n for n, _, _ in BATCH), 64, dtype=dtype)
    md = _metadata()
    results = []
    for choose in (_torch_paths, choose_kernels):
        choose(layer)
        layer.bind_state(conv_state.clone(), ssm_state.clone())
        with set_forward_context(md):
            out = layer(hidden)
        results.append((out, layer.conv_state, layer.ssm_state))
    (expected, conv_expected, ssm_expected), (out, conv_after, ssm_after) = results
    assert not out.isnan().any()
    tight = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    decodes = md.num_decodes  # apart, so that a failure names the path
    torch.testing.assert_close(out[:decodes], expected[:decodes], **tight)
    # flash-linear-attention's chunked rule multiplies in TF32 for float32 (in bf16 for bfloat16)
    # where the torch reference multiplies in float32; and in bfloat16 the kernels' prefill rounds
    # the normalised q and k to bf16 (normalised in place) where the reference keeps them in
    # float32, an error the chunks' recurrence carries: either way its errors scale with the
    # outputs. (A state row read or written at the wrong place is off by the outputs' size.)
    scaled = with_fla or dtype != torch.float32
    scale = expected.abs().max().item() * (1e-2 if dtype == torch.float32 else 5e-2)
    prefill_tol = dict(atol=scale, rtol=0.0) if scaled else tight
    torch.testing.assert_close(out[decodes:], expected[decodes:], **prefill_tol)
    rows = md.state_slots
    torch.testing.assert_close(conv_after[rows], conv_expected[rows], **tight)
    state_scale = ssm_expected[rows].abs().max().item() * (1e-2 if dtype == torch.float32 else 5e-2)
    torch.testing.assert_close(
        ssm_after[rows], ssm_expected[rows], **(dict(atol=state_scale, rtol=0.0) if scaled else tight)
    )
    # Rows no sequence of the step owns are untouched, bit for bit.
    others = [r for r in range(NUM_ROWS) if r not in {s % NUM_ROWS for _, _, s in BATCH}]
    torch.testing.assert_close(ssm_after[others], ssm_state[others], atol=0, rtol=0)
