"""The one directory pagedllm caches what it derives in (converted tokenizers, GGUF configs, built
kernels): ``$PAGEDLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedllm``, else ``~/.cache/pagedllm``.

The cache is optional: a directory that is read-only or full slows a start (the next one derives
or builds again) and never stops it. Writers save through ``save_atomically``, which warns and
goes on, and never leaves half an entry behind.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "pagedllm"


def save_atomically(dest: str | Path, write: Callable[[str], None], what: str, is_dir: bool = False) -> bool:
    """Cache an entry at ``dest``: ``write(staging)`` fills a staging file (or directory, with
    ``is_dir``) beside it, which is then renamed to ``dest``, so that a concurrent reader never
    sees half an entry. Returns whether it was saved; on an OSError (a read-only or full disk)
    it logs a warning naming ``what``, removes the staging and returns False."""
    dest = str(dest)
    staging = None
    try:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if is_dir:
            staging = tempfile.mkdtemp(dir=os.path.dirname(dest), prefix=".staging-")
        else:
            fd, staging = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=".staging-")
            os.close(fd)
        write(staging)
        os.replace(staging, dest)
        return True
    except OSError as e:
        logger.warning("not caching %s in %s (%s); going on without it", what, cache_root(), e)
        if staging is not None:
            _remove(staging)
        return False


def writable_dir(path: Path, what: str) -> Path:
    """``path``, created; where it cannot be (a read-only or full cache), a fresh temporary
    directory instead, with a warning naming ``what`` (its content is then not kept)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
        reason = "not writable"
    except OSError as e:
        reason = str(e)
    temporary = Path(tempfile.mkdtemp(prefix="pagedllm-"))
    atexit.register(shutil.rmtree, temporary, True)
    logger.warning("cannot cache %s in %s (%s); using %s for this run", what, path, reason, temporary)
    return temporary


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)
