"""The CUDA-graph runner's capture, with torch.cuda's graph calls stood in for so that it runs
without a GPU: what a captured pass derives from its metadata once for all its layers
(``ForwardContext.once``: a hybrid's decode state rows) is derived inside the capture, so that its
kernels replay with every step, not frozen at a warm-up run's value. A model that asks for one such
value, and records whether it was made while capturing, stands in for the layers."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch import nn

from pagedllm.attention.forward_context import ForwardContext, get_forward_context
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.worker.cuda_graph import CudaGraphRunner


class HostBuffers:
    """The runner's static input buffers, on the host (InputBuffers keeps none there)."""

    def __init__(self) -> None:
        self.arrays: dict[str, torch.Tensor] = {}

    def put(self, name: str, array: np.ndarray) -> None:
        self.arrays[name] = torch.as_tensor(array)

    def device_view(self, name: str, num_rows: int) -> torch.Tensor:
        return self.arrays[name][:num_rows]


class DerivingModel(nn.Module):
    """Two layers reading one derived value: each pass records (value, capturing)."""

    def __init__(self, capturing: list[bool]) -> None:
        super().__init__()
        self.capturing = capturing
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        for _ in range(2):
            made_while_capturing = context.once("rows", lambda: self.capturing[0])
            self.seen.append((made_while_capturing, self.capturing[0]))
        return input_ids + positions


@pytest.fixture
def fake_graphs(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    capturing = [False]

    @contextlib.contextmanager
    def graph(_graph, pool=None):
        capturing[0] = True
        try:
            yield
        finally:
            capturing[0] = False

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return capturing


def test_a_capture_derives_its_values_inside_the_capture(fake_graphs: list[bool]) -> None:
    model = DerivingModel(fake_graphs)
    runner = CudaGraphRunner(model, HostBuffers(), capture_sizes=[1, 4], max_model_len=32)
    runner.capture()
    captured = [made for made, capturing in model.seen if capturing]
    assert len(captured) == 2 * 2  # two sizes, two layers each
    assert all(captured), "a captured pass reused a value derived in a warm-up run"
    warm_up = [made for made, capturing in model.seen if not capturing]
    assert len(warm_up) == 2 * 2 * 2 and not any(warm_up)


def test_a_context_derives_once_and_only_for_itself() -> None:
    md = AttentionMetadata.__new__(AttentionMetadata)  # never read: the value is keyed by the pass
    calls = []
    first, second = ForwardContext(md), ForwardContext(md)
    assert first.once("x", lambda: calls.append(1) or len(calls)) == 1
    assert first.once("x", lambda: calls.append(1) or len(calls)) == 1
    assert second.once("x", lambda: calls.append(1) or len(calls)) == 2
    assert len(calls) == 2
