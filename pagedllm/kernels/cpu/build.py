"""Build the CPU kernels (and other C++ extensions) on first use and keep the build in the user's
cache directory.

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
import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path
from types import ModuleType

import torch

from pagedllm.cache_dir import cache_root, writable_dir
from pagedllm.cpu_info import cpu_isa_key

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "binding.cpp",
    "cache.cpp",
    "int4_matmul.cpp",
    "int4_prefill.cpp",
    "paged_attention.cpp",
    "rms_norm.cpp",
    "rotary.cpp",
    "sampling.cpp",
)
EXTENSION_NAME = "pagedllm_cpu_ext"

# -fopenmp: at::parallel_for's OpenMP loop and the `omp simd` reductions (the process's OpenMP
# runtime is torch's own libgomp, already loaded, so no second thread pool appears).
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp")


def cache_dir(csrc: Path | None = None, cxx_flags: tuple[str, ...] = CXX_FLAGS) -> Path:
    """Where a build lives: per torch version (it links against it), per CPU, and per content of
    the sources and flags, so that an existing library is always the current one."""
    csrc = CSRC if csrc is None else csrc
    content = hashlib.sha256(" ".join(cxx_flags).encode())
    for path in sorted(csrc.iterdir()):
        content.update(path.name.encode() + path.read_bytes())
    torch_version = f"torch-{torch.__version__}".replace("+", "-")
    return cache_root() / "cpu-ext" / torch_version / cpu_isa_key() / content.hexdigest()[:16]


def check_build_requirements() -> None:
    """Raise RuntimeError naming the first thing the build lacks."""
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        raise RuntimeError(
            f"building pagedllm's C++ extensions needs a C++ compiler ({compiler!r} is not on PATH; "
            "set CXX to another)"
        )
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("building pagedllm's C++ extensions needs ninja: pip install ninja")


def build_extension(
    name: str,
    csrc: Path,
    sources: tuple[str, ...],
    cxx_flags: tuple[str, ...],
    ldflags: tuple[str, ...] = (),
    python_module: bool = False,
    description: str | None = None,
) -> ModuleType | None:
    """Build (on the machine's first call) and load the extension ``name`` from ``csrc``: a Python
    module (returned) or a library of torch operators (registered; None returned). ``description``
    names it in the notice that a build starts."""
    build_dir = cache_dir(csrc, cxx_flags)
    library = build_dir / f"{name}.so"
    if library.exists():
        try:
            return _import(name, library) if python_module else torch.ops.load_library(str(library))
        except (OSError, ImportError):  # a library another process is still linking: wait below
            pass
    check_build_requirements()
    from torch.utils import cpp_extension

    build_dir = writable_dir(build_dir, description or name)
    # A warning, so that even a script that configured no logging says why its first run pauses.
    logger.warning(
        "building %s (about a minute the first time; cached in %s)", description or name, build_dir
    )
    start = time.perf_counter()
    module = cpp_extension.load(
        name=name,
        sources=[str(csrc / source) for source in sources],
        extra_cflags=list(cxx_flags),
        extra_ldflags=list(ldflags),
        build_directory=str(build_dir),
        is_python_module=python_module,
        verbose=logger.isEnabledFor(logging.DEBUG),
    )
    logger.info("built %s in %.0f s (cached in %s)", name, time.perf_counter() - start, build_dir)
    return module if python_module else None


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load() -> None:
    """Build (on the machine's first call) and load the CPU kernels: their operators are then
    ``torch.ops.pagedllm_cpu.*``."""
    build_extension(
        EXTENSION_NAME,
        CSRC,
        SOURCES,
        CXX_FLAGS,
        ("-fopenmp",),
        description="pagedllm's CPU kernels for this CPU",
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
