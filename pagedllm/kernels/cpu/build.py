"""Build the CPU kernels on first use and keep the build in the user's cache directory.

``load()`` compiles ``csrc/`` for this machine's CPU (``-march=native``, so the compiler uses its
AVX-512 or AVX2 units) with ``torch.utils.cpp_extension.load`` and registers its operators under
``torch.ops.pagedllm_cpu``. The first build takes ~15-20 s on two cores (parsing torch's headers is
most of it); later calls, in this process or another one, load it from the build directory
without invoking ninja (which alone costs ~0.8 s a start). A file lock in the build directory
lets concurrent processes wait for one build instead of racing. The directory is
``<cache>/cpu-ext/<torch version>/<cpu key>/<sources key>`` under the directory the rest of
pagedllm caches in (``pagedllm.cache_dir``); the CPU key (``cpu_isa_key``) keeps a build off
machines whose CPU lacks its instructions.

Where the build cannot work (no C++ compiler, no ninja), ``load()`` raises a RuntimeError that
names what is missing; callers fall back to their PyTorch formulation.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from pagedllm.cache_dir import cache_root
from pagedllm.cpu_info import cpu_isa_key

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "binding.cpp",
    "cache.cpp",
    "int4_matmul.cpp",
    "paged_attention.cpp",
    "rms_norm.cpp",
    "rotary.cpp",
    "sampling.cpp",
)
EXTENSION_NAME = "pagedllm_cpu_ext"

# -fopenmp: at::parallel_for's OpenMP loop and the `omp simd` reductions (the process's OpenMP
# runtime is torch's own libgomp, already loaded, so no second thread pool appears).
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp")


def cache_dir() -> Path:
    """Where the build lives: per torch version (it links against it), per CPU, and per content
    of the sources and flags, so that an existing library is always the current one."""
    content = hashlib.sha256(" ".join(CXX_FLAGS).encode())
    for path in sorted(CSRC.iterdir()):
        content.update(path.name.encode() + path.read_bytes())
    torch_version = f"torch-{torch.__version__}".replace("+", "-")
    return cache_root() / "cpu-ext" / torch_version / cpu_isa_key() / content.hexdigest()[:16]


def check_build_requirements() -> None:
    """Raise RuntimeError naming the first thing the build lacks."""
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        raise RuntimeError(
            f"building pagedllm's CPU kernels needs a C++ compiler ({compiler!r} is not on PATH; "
            "set CXX to another)"
        )
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("building pagedllm's CPU kernels needs ninja: pip install ninja")


@functools.cache
def load() -> None:
    """Build (on the machine's first call) and load the extension: its operators are then
    ``torch.ops.pagedllm_cpu.*``."""
    build_dir = cache_dir()
    library = build_dir / f"{EXTENSION_NAME}.so"
    if library.exists():
        try:
            torch.ops.load_library(str(library))
            return
        except OSError:  # a library another process is still linking: wait for its build below
            pass
    check_build_requirements()
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(CSRC / source) for source in SOURCES],
        extra_cflags=list(CXX_FLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=logger.isEnabledFor(logging.DEBUG),
    )
    logger.info(
        "built pagedllm's CPU kernels in %.0f s (cached in %s)", time.perf_counter() - start, build_dir
    )


@functools.cache
def available() -> bool:
    """Whether the kernels load here (building them on the first call); logs why not, once.
    ``PAGEDLLM_CPU_KERNELS=0`` turns them off: every caller then takes its PyTorch path."""
    if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") == "0":
        return False
    try:
        load()
    except Exception as e:  # no compiler, a failed build: the PyTorch paths compute the same
        logger.warning("pagedllm's CPU kernels are unavailable (%s); using the PyTorch paths", e)
        return False
    return True
