"""The cache directory is optional: a read-only or full one slows a start and never stops it, and
a save that fails leaves no staging behind."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from pagedllm.cache_dir import save_atomically, writable_dir


def _unwritable(tmp_path: Path) -> Path:
    """A cache path nothing can be created under, even by root (a regular file is in the way)."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    return blocker / "cache"


@pytest.mark.parametrize("is_dir", [False, True])
def test_a_save_that_fills_the_disk_leaves_nothing_behind(tmp_path: Path, caplog, is_dir: bool):
    def write(staging: str) -> None:
        path = os.path.join(staging, "tokenizer.json") if is_dir else staging
        with open(path, "w") as f:
            f.write("{half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    dest = tmp_path / "kind" / "entry"
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        assert not save_atomically(dest, write, "the test entry", is_dir=is_dir)
    assert os.listdir(tmp_path / "kind") == []
    [message] = [record.getMessage() for record in caplog.records]
    assert message.startswith("not caching the test entry in ")
    assert "No space left on device" in message and message.endswith("going on without it")


def test_a_save_that_succeeds_is_renamed_into_place(tmp_path: Path):
    dest = tmp_path / "kind" / "entry.json"
    assert save_atomically(dest, lambda staging: Path(staging).write_text("{}"), "the test entry")
    assert os.listdir(tmp_path / "kind") == ["entry.json"] and dest.read_text() == "{}"


def test_an_unwritable_build_directory_is_replaced_by_a_temporary_one(tmp_path: Path, caplog):
    wanted = _unwritable(tmp_path) / "cpu-ext"
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        build_dir = writable_dir(wanted, "the test kernels")
    assert build_dir != wanted and build_dir.is_dir() and os.access(build_dir, os.W_OK)
    assert f"cannot cache the test kernels in {wanted}" in caplog.text
    assert f"using {build_dir} for this run" in caplog.text


# Slow (~7 s): the embedded model loaded in a fresh process.
@pytest.mark.slow
def test_a_gguf_loads_with_an_unwritable_cache(smollm2_gguf: str, smollm2_tokenizer, tmp_path, monkeypatch):
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.tokenizer import get_tokenizer

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(_unwritable(tmp_path)))
    model_config = EngineArgs(model=smollm2_gguf, device="cpu").create_engine_config().model_config
    assert model_config.hf_config.hidden_size == 576 and model_config.hf_config.num_hidden_layers == 30
    tokenizer = get_tokenizer(model_config)
    text = "The capital of France is Paris."
    assert tokenizer(text)["input_ids"] == smollm2_tokenizer(text)["input_ids"]
