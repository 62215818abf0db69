"""Build the CUDA kernels on first use and keep the build in the user's cache directory.

``load()`` compiles ``csrc/`` with ``torch.utils.cpp_extension.load`` and returns the extension
module. Ninja builds the four sources in parallel: about 65 s of compiler time in all (the two
attention files, 54 instantiations each, ~20 s apiece; the torch binding ~20 s), so under 30 s on a
machine with four or more cores. Later calls, in this process or
another one, reuse the build: cpp_extension rebuilds only when a source or a flag changed, and a
file lock in the build directory lets concurrent processes (tensor-parallel workers) wait for one
build instead of racing. The directory is ``<cache>/cuda-ext/<torch version>``
under the directory the rest of pagedllm caches in (``pagedllm.cache_dir``).

Where the build cannot work (a CPU-only torch, no GPU, no nvcc, no ninja), ``load()`` raises a
RuntimeError that names what is missing, before invoking any compiler.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from pagedllm.cache_dir import cache_root, writable_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("binding.cpp", "cache_kernels.cu", "paged_attention_v1.cu", "paged_attention_v2.cu")
EXTENSION_NAME = "pagedllm_cuda_ext"

# cpp_extension adds the C++ standard (C++17 or later; the sources need 17) and its own defines.
CUDA_FLAGS = (
    "-O3",
    # Hopper's own machine code (H100, H200): the GPUs this is built and measured for.
    "-gencode=arch=compute_90a,code=sm_90a",
    # PTX that the driver compiles at load time on any other GPU from Ampere on (bfloat16 needs
    # sm_80). Passing any -gencode stops cpp_extension from adding its own architecture flags.
    "-gencode=arch=compute_80,code=compute_80",
    # Source lines in the binary, for compute-sanitizer and profilers; the code is unchanged.
    # No --use_fast_math: the kernels call the fast intrinsics where they want them (__expf,
    # __fdividef in the softmax) and keep IEEE float everywhere else; being memory-bound, they
    # would gain nothing from approximating the rest.
    "-lineinfo",
)


def cache_dir() -> Path:
    """Where the build lives: one directory per torch version (the extension links against it)."""
    return cache_root() / "cuda-ext" / f"torch-{torch.__version__}".replace("+", "-")


def check_build_requirements() -> None:
    """Raise RuntimeError naming the first thing the build or the kernels lack."""
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        raise RuntimeError(
            f"pagedllm's CUDA kernels need a CUDA build of PyTorch; this one ({torch.__version__}) is "
            "CPU-only. Use attention_backend='triton' or 'torch'."
        )
    if not torch.cuda.is_available():
        raise RuntimeError("pagedllm's CUDA kernels need a CUDA GPU, and none is visible")
    if torch.cuda.get_device_capability() < (8, 0):
        raise RuntimeError(
            f"pagedllm's CUDA kernels need compute capability 8.0 or later; "
            f"{torch.cuda.get_device_name()} is {torch.cuda.get_device_capability()}"
        )
    cuda_home = cpp_extension.CUDA_HOME
    if cuda_home is None or not os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        raise RuntimeError(
            "building pagedllm's CUDA kernels needs nvcc: install the CUDA toolkit matching torch's "
            f"CUDA {torch.version.cuda}, or set CUDA_HOME to it"
        )
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("building pagedllm's CUDA kernels needs ninja: pip install ninja")


@functools.cache
def load() -> ModuleType:
    """The compiled extension (built on the first call of the machine's first process)."""
    check_build_requirements()
    from torch.utils import cpp_extension

    build_dir = writable_dir(cache_dir(), "pagedllm's CUDA kernels")
    logger.info("loading pagedllm's CUDA kernels from %s (a first build takes under a minute)", build_dir)
    return cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(CSRC / source) for source in SOURCES],
        extra_cflags=["-O3"],
        extra_cuda_cflags=list(CUDA_FLAGS),
        build_directory=str(build_dir),
        verbose=logger.isEnabledFor(logging.DEBUG),
    )
