"""The platform module: what a device offers, asked once per device, without importing a kernel."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import pagedllm.platform
from pagedllm.cpu_info import cpu_has_bf16
from pagedllm.platform import Platform, platform_for


def test_the_cpu_offers_its_kernels_and_no_gpu_feature() -> None:
    cpu = platform_for(torch.device("cpu"))
    assert cpu.is_cpu() and not cpu.is_cuda()
    assert not cpu.triton and cpu.device_capability is None and not cpu.supports_pdl
    assert cpu.onednn == torch.backends.mkldnn.is_available()
    assert cpu.cpu_bf16 == cpu_has_bf16()


def test_a_device_is_asked_once() -> None:
    assert platform_for(torch.device("cpu")) is platform_for(torch.device("cpu"))


def test_the_meta_device_offers_nothing() -> None:
    meta = platform_for(torch.device("meta"))
    assert meta.device_type == "meta" and not meta.is_cpu() and not meta.is_cuda()
    assert not (meta.triton or meta.cpu_kernels or meta.onednn or meta.cpu_bf16)


def test_the_switch_turns_the_cpu_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    assert not platform_for.__wrapped__(torch.device("cpu")).cpu_kernels  # uncached: a fresh process
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "1")
    assert platform_for.__wrapped__(torch.device("cpu")).cpu_kernels


@pytest.mark.parametrize(
    "capability, pdl", [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)]
)
def test_pdl_from_hopper_on(capability: tuple[int, int], pdl: bool) -> None:
    gpu = Platform("cuda", True, capability, cpu_kernels=False, onednn=False, cpu_bf16=False)
    assert gpu.is_cuda() and gpu.supports_pdl == pdl


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_offers_triton_where_it_is_installed() -> None:
    from pagedllm.platform import triton_installed

    gpu = platform_for(torch.device("cuda", 0))
    assert gpu.triton == triton_installed()
    assert gpu.device_capability == torch.cuda.get_device_capability(0)
    assert not (gpu.cpu_kernels or gpu.onednn or gpu.cpu_bf16)


def test_the_module_imports_no_kernel_and_not_triton() -> None:
    """A base module (tests/test_layering.py says which modules it may import): triton is looked
    up by name, never imported, so asking costs no import and fixes no TRITON_INTERPRET."""
    tree = ast.parse(Path(pagedllm.platform.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {m for m in imported if m.startswith(("triton", "pagedllm.kernels"))}
