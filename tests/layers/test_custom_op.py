"""Layers choose their implementation once, where they are bound to their device (CustomOp):
at construction, again on ``.to()``, never per call; the chosen one computes the torch reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedllm.kernels.cpu.build import available as cpu_kernels_available
from pagedllm.layers import custom_op
from pagedllm.layers.activation import SigmoidGate, SiluAndMul
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.layernorm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.platform import platform_for

ROPE = {"rope_type": "default", "rope_theta": 10000.0}
KERNELS = pytest.mark.skipif(not cpu_kernels_available(), reason="the CPU kernels did not build here")


def _layers() -> list[custom_op.CustomOp]:
    return [
        RMSNorm(64),
        GemmaRMSNorm(64),
        SiluAndMul(),
        SigmoidGate(),
        RotaryEmbedding(64, 128, ROPE, torch.get_default_dtype()),
        FusedMoE(4, 2, 64, 32, True),
    ]


@KERNELS
def test_the_cpu_norm_takes_its_kernel_in_bf16_only_and_follows_casts() -> None:
    norm = RMSNorm(64)
    assert norm.forward_method == norm.forward_torch  # float32: the oracle's dtype
    norm.to(torch.bfloat16)
    assert norm.forward_method == norm.forward_cpu
    x = torch.randn(5, 64).to(torch.bfloat16)
    torch.testing.assert_close(norm(x.clone()), norm.forward_torch(x), atol=0, rtol=2**-7)  # one bf16 ulp
    norm.float()
    assert norm.forward_method == norm.forward_torch
    assert torch.equal(norm(x.float()), norm.forward_torch(x.float()))


@KERNELS
def test_a_layer_built_in_bf16_is_bound_at_construction() -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        norm, gemma = RMSNorm(64), GemmaRMSNorm(64)
    finally:
        torch.set_default_dtype(previous)
    assert norm.forward_method == norm.forward_cpu
    assert gemma.forward_method == gemma.forward_torch  # the C++ kernel has Llama's order only


@KERNELS
def test_the_cpu_rotary_takes_its_kernel_in_every_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        rotary = RotaryEmbedding(64, 128, ROPE, dtype)
        assert rotary.forward_method == rotary.forward_cpu
        positions = torch.tensor([3, 0, 127])
        q, k = torch.randn(3, 4 * 64).to(dtype), torch.randn(3, 2 * 64).to(dtype)
        q_out, k_out = rotary(positions, q.clone(), k.clone())
        q_ref, k_ref = rotary.forward_torch(positions, q, k)
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_layers_without_a_kernel_here_take_the_torch_path() -> None:
    for layer in (SiluAndMul(), SigmoidGate(), FusedMoE(4, 2, 64, 32, True)):
        assert layer.forward_method == layer.forward_torch
    assert layer.route == layer.route_torch  # the experts' router is chosen with them


def test_the_meta_device_takes_the_torch_path() -> None:
    with torch.device("meta"):
        layers = _layers()
    for layer in layers:
        assert layer.device.type == "meta" and layer.forward_method == layer.forward_torch


def test_the_choice_is_made_when_bound_to_a_device_not_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer asks its device's platform when bound, and no more: a step asks nothing."""
    asked: list[torch.device] = []

    def triton_platform(device: torch.device):
        asked.append(device)
        return dataclasses.replace(platform_for(device), triton=True)

    monkeypatch.setattr(custom_op, "platform_for", triton_platform)
    layers = _layers()
    assert len(asked) == len(layers)
    for layer in layers:
        assert layer.forward_method == layer.forward_triton
    norm, gemma, act, gate, rotary, moe = layers
    assert moe.route == moe.route_triton

    def ask_nothing(device: torch.device):
        raise AssertionError("a forward asked the platform")

    monkeypatch.setattr(custom_op, "platform_for", ask_nothing)
    # The layers now run what they chose: point them at their torch paths (no GPU here) and step.
    for layer in layers:
        layer.forward_method = layer.forward_torch
    moe.route = moe.route_torch
    x = torch.randn(3, 64)
    norm(x)
    gemma(x)
    act(x)
    gate(x.view(3, 2, 32), x.view(3, 2, 32))
    rotary(torch.tensor([0, 1, 2]), torch.randn(3, 128), torch.randn(3, 64))
    moe(x, torch.randn(3, 4))


def test_a_partial_rotary_takes_the_triton_kernel_where_triton_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Part of each head rotated (Qwen3-Next's quarter of 256): the Triton kernel rotates it in
    place; without Triton, the torch path (the C++ kernel rotates whole heads only)."""
    partial = {**ROPE, "partial_rotary_factor": 0.25}
    rotary = RotaryEmbedding(256, 128, partial, torch.get_default_dtype())
    assert rotary.rotary_dim == 64 and rotary.forward_method == rotary.forward_torch
    monkeypatch.setattr(
        custom_op, "platform_for", lambda device: dataclasses.replace(platform_for(device), triton=True)
    )
    rotary = RotaryEmbedding(256, 128, partial, torch.get_default_dtype())
    assert rotary.forward_method == rotary.forward_triton


def test_a_move_rebinds_every_layer_of_a_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.to()`` reaches each layer's ``_apply``: the layers follow the model's device and
    dtype, those without tensors (the activation) included."""
    model = torch.nn.Sequential(*_layers())
    bound: list[tuple[torch.device, torch.dtype]] = []
    original_bind = custom_op.CustomOp._bind

    def recording_bind(self: custom_op.CustomOp, device: torch.device, dtype: torch.dtype) -> None:
        bound.append((device, dtype))
        original_bind(self, device, dtype)

    monkeypatch.setattr(custom_op.CustomOp, "_bind", recording_bind)
    model.to(torch.bfloat16)
    assert bound == [(torch.device("cpu"), torch.bfloat16)] * len(model)
    assert all(layer.dtype == torch.bfloat16 for layer in model)


def test_a_subclass_overriding_a_bound_forward_is_refused_when_defined() -> None:
    """A layer whose instances take the chosen method as their forward (``forward_only_dispatches``)
    would skip a subclass's own forward: such a subclass is refused when its class is made."""
    with pytest.raises(TypeError, match=r"Wrapped overrides forward.*set forward_only_dispatches = False"):

        class Wrapped(RMSNorm):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return 2 * super().forward(x)

    class Declared(RMSNorm):
        forward_only_dispatches = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    x = torch.randn(3, 8)
    torch.testing.assert_close(Declared(8, eps=1e-6)(x), 2 * RMSNorm(8, eps=1e-6)(x))
