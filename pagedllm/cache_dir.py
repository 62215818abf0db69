"""The one directory pagedllm caches what it derives in (converted tokenizers, GGUF configs, built
kernels): ``$PAGEDLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedllm``, else ``~/.cache/pagedllm``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "pagedllm"
