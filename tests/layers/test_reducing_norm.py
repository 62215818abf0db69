"""RMSNorm.reduce_partial_input's dispatch: which path a call takes depends on the message alone
(every rank must take the same one): the fused all-reduce + norm kernel for one row where a
symmetric-memory communicator exists, else the all-reduce then the norm; no reduction without a
residual (the embedding's output is whole)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import pagedllm.kernels.triton.all_reduce_norm as all_reduce_norm
import pagedllm.layers.layernorm as layernorm
from pagedllm.layers.layernorm import GemmaRMSNorm, RMSNorm


class FakeComm:
    """The communicator's surface the norm reads; every message fits."""

    peer_buffers, flag_offset, rank = "peers", 123, 0

    def should_use(self, x: torch.Tensor) -> bool:
        return True


def _norm_with(monkeypatch, norm_class=RMSNorm, comm=None):
    calls = []
    monkeypatch.setattr(layernorm, "get_symm_mem_all_reduce", lambda: comm)
    monkeypatch.setattr(
        layernorm, "tensor_model_parallel_all_reduce", lambda x: calls.append("all_reduce") or x * 2
    )

    def fused(x, residual, weight, eps, peers, flag_offset, rank):
        calls.append(("fused", tuple(x.shape), peers, flag_offset, rank))
        return x, residual

    monkeypatch.setattr(all_reduce_norm, "all_reduce_add_rms_norm", fused)
    norm = norm_class(8)
    norm.reduce_partial_input()
    return norm, calls


def test_without_a_communicator_the_sum_comes_first_then_the_same_norm(monkeypatch):
    norm, calls = _norm_with(monkeypatch)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    out, stream = norm(x.clone(), residual.clone())
    reference = RMSNorm(8)
    want_out, want_stream = reference(x * 2, residual)
    assert calls == ["all_reduce"]
    assert torch.equal(out, want_out) and torch.equal(stream, want_stream)
    # No residual: the input is whole, normalized as it is.
    assert torch.equal(norm(x), reference(x)) and calls == ["all_reduce"]


def test_with_a_communicator_one_row_takes_the_fused_kernel_and_more_rows_do_not(monkeypatch):
    platform = SimpleNamespace(triton=True)
    norm, calls = _norm_with(monkeypatch, comm=FakeComm())
    method = norm.forward_torch
    forward = layernorm._reducing(norm, method, platform)
    forward(torch.randn(1, 8), torch.randn(1, 8))
    forward(torch.randn(2, 8), torch.randn(2, 8))
    forward(torch.randn(1, 8))
    assert calls == [("fused", (1, 8), "peers", 123, 0), "all_reduce"]
    # Gemma's rounding is not the kernel's: its norms sum first, whatever the size.
    gemma, gemma_calls = _norm_with(monkeypatch, GemmaRMSNorm, comm=FakeComm())
    layernorm._reducing(gemma, gemma.forward_torch, platform)(torch.randn(1, 8), torch.randn(1, 8))
    assert gemma_calls == ["all_reduce"]
