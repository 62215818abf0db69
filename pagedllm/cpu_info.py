"""What the host CPU offers the CPU path: bf16 units and physical cores (Linux /proc/cpuinfo)."""

from __future__ import annotations

import functools
import hashlib
import os

# Flags of bf16 dot-product units: AVX512-BF16 (Cooper Lake, Zen 4 and later) or AMX.
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def _cpuinfo_records() -> list[dict[str, str]]:
    """One dict per logical CPU; empty where /proc/cpuinfo is unreadable (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            blocks = f.read().strip().split("\n\n")
    except OSError:
        return []
    return [
        {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in block.splitlines())}
        for block in blocks
    ]


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (False where unknown)."""
    records = _cpuinfo_records()
    flags = records[0].get("flags", "").split() if records else []
    return any(flag in flags for flag in _BF16_CPU_FLAGS)


@functools.cache
def physical_cpu_cores() -> int:
    """Physical cores this process may run on: hyperthread siblings share a core's matmul units,
    so a second thread per core only adds OpenMP barrier waits."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = {
        (r.get("physical id"), r.get("core id"))
        for r in _cpuinfo_records()
        if r.get("processor", "").isdigit() and int(r["processor"]) in allowed and "core id" in r
    }
    return max(1, len(cores) or len(allowed))


@functools.cache
def cpu_isa_key() -> str:
    """A short key of this CPU's model and instruction set extensions: code compiled for the host
    (``-march=native``) is cached under it, so a cache directory shared by machines with other
    CPUs never hands one of them instructions it lacks."""
    records = _cpuinfo_records()
    first = records[0] if records else {}
    described = f"{first.get('model name', '')}|{first.get('flags', '')}|{os.uname().machine}"
    return hashlib.sha256(described.encode()).hexdigest()[:12]
