"""What a device offers the code that picks kernels for it, said once per device.

Layers, the sampler and the attention backends read a device's ``Platform`` where they are built
or bound to their device, and keep the implementation they pick: the step itself asks nothing.
One platform per device rather than one per process (vLLM's ``current_platform``): an engine may
run on the CPU of a machine with a GPU, and tests build layers on the CPU and move them.

A base module: it imports no kernel, and looks triton up by name only (importing it would cost
the import on machines that never use it, and fix ``TRITON_INTERPRET`` for the process before the
kernel tests set it).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

from pagedllm.cpu_info import cpu_has_bf16


@dataclass(frozen=True)
class Platform:
    """One device's capabilities (``platform_for``)."""

    # "cuda", "cpu", or another torch device type ("meta" while a model's size is measured).
    device_type: str
    # Triton's kernels run here: a CUDA device with the triton package installed. Elsewhere the
    # layers take their torch paths (Triton's interpreter runs on the CPU only where a test asks).
    triton: bool
    # CUDA compute capability (major, minor); None off CUDA.
    device_capability: tuple[int, int] | None
    # The C++ CPU kernels may run here: the CPU, unless PAGEDLLM_CPU_KERNELS=0 switches them off.
    # Whether they build is known only by building them (``kernels.cpu.build.available``).
    cpu_kernels: bool
    # oneDNN's matmuls (torch built with mkldnn), on the CPU.
    onednn: bool
    # The CPU computes bf16 matmuls natively (AVX512-BF16 or AMX); False off the CPU.
    cpu_bf16: bool

    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    @property
    def supports_pdl(self) -> bool:
        """Programmatic dependent launch (Hopper, compute capability 9.0, and later)."""
        return self.device_capability is not None and self.device_capability[0] >= 9

    @property
    def supports_tma(self) -> bool:
        """The Tensor Memory Accelerator, tiles copied by descriptor (Hopper and later)."""
        return self.device_capability is not None and self.device_capability[0] >= 9


@functools.cache
def platform_for(device: torch.device) -> Platform:
    """The platform of ``device`` (asked of the driver once per device and process)."""
    device = torch.device(device)
    is_cuda, is_cpu = device.type == "cuda", device.type == "cpu"
    return Platform(
        device_type=device.type,
        triton=is_cuda and triton_installed(),
        # None where CUDA is not there to ask (config refuses such a device before any model).
        device_capability=(
            torch.cuda.get_device_capability(device) if is_cuda and torch.cuda.is_available() else None
        ),
        cpu_kernels=is_cpu and os.environ.get("PAGEDLLM_CPU_KERNELS", "1") != "0",
        onednn=is_cpu and torch.backends.mkldnn.is_available(),
        cpu_bf16=is_cpu and cpu_has_bf16(),
    )


@functools.cache
def triton_installed() -> bool:
    """Whether the triton package is installed (looked up, not imported: see the module docstring)."""
    return importlib.util.find_spec("triton") is not None
