"""pagedllm: LLM inference and serving with PagedAttention and continuous batching."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# torch.cuda.is_available() then asks NVML instead of initialising the CUDA driver, which would
# leave this process unable to fork ranks that use CUDA (torch's "poisoned fork"): a script that
# checks for a GPU before building a multi-GPU engine keeps forked ranks (executor/multiproc_executor.py).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

# The public names are imported on first use (PEP 562): importing the engine costs seconds
# (torch, transformers), which every ``pagedllm`` command would pay before parsing its arguments,
# `pagedllm --help` included.
_LAZY_IMPORTS = {
    "LLM": "pagedllm.entrypoints.llm",
    "BeamSearchParams": "pagedllm.sampling_params",
    "CompletionOutput": "pagedllm.outputs",
    "EngineArgs": "pagedllm.engine.arg_utils",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "RequestOutput": "pagedllm.outputs",
    "SamplingParams": "pagedllm.sampling_params",
}

if TYPE_CHECKING:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.outputs import CompletionOutput, RequestOutput
    from pagedllm.sampling_params import BeamSearchParams, SamplingParams

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY_IMPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_IMPORTS))
