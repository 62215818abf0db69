"""A GGUF's config is derived once and read back from its cache: the same fields, and without
importing the model's transformers config class (seconds and ~150 MB at every start)."""

from __future__ import annotations

import os
import subprocess
import sys

from transformers import LlamaConfig, PretrainedConfig, Qwen3Config, Qwen3MoeConfig

from pagedllm.model_loader.gguf_loader import _fields_only, load_gguf_config
from pagedllm.tokenizer import gguf_cache_path


def test_cached_config_has_every_field_and_skips_the_class_import(smollm2_gguf: str, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    derived = load_gguf_config(smollm2_gguf)
    assert isinstance(derived, LlamaConfig)
    cached = load_gguf_config(smollm2_gguf)
    assert type(cached) is PretrainedConfig
    # Every field, read as the engine reads them (transformers 5 keeps use_cache out of a plain
    # config: generation's business, not the engine's).
    fields = set(derived.to_dict()) - {"transformers_version", "use_cache"}
    assert {"hidden_size", "num_key_value_heads", "rms_norm_eps", "rope_parameters", "model_type"} <= fields
    assert {f: getattr(cached, f) for f in fields} == {f: getattr(derived, f) for f in fields}
    # A fresh process reading the cache never imports the config class.
    probe = (
        "import sys; from pagedllm.model_loader.gguf_loader import load_gguf_config; "
        f"load_gguf_config({smollm2_gguf!r}); "
        "print('transformers.models.llama.configuration_llama' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PAGEDLLM_CACHE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_a_corrupt_cached_config_is_derived_again(smollm2_gguf: str, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    derived = load_gguf_config(smollm2_gguf)
    [cached_file] = (tmp_path / "gguf-configs").glob("*.json")
    cached_file.write_text('{"hidden_size": 5')  # a write cut short
    again = load_gguf_config(smollm2_gguf)
    assert isinstance(again, LlamaConfig) and again.to_dict() == derived.to_dict()
    assert type(load_gguf_config(smollm2_gguf)) is PretrainedConfig  # and cached again


def test_only_classes_that_add_nothing_but_fields_are_cached(smollm2_gguf: str, tmp_path, monkeypatch):
    assert _fields_only(LlamaConfig) and _fields_only(Qwen3Config)
    # num_experts is an alias of num_local_experts there: a plain config would lose it.
    assert not _fields_only(Qwen3MoeConfig)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    load_gguf_config(smollm2_gguf)
    assert (tmp_path / "gguf-configs").is_dir()
    assert len(list((tmp_path / "gguf-configs").glob("*.json"))) == 1
    assert gguf_cache_path(smollm2_gguf, "gguf-configs").startswith(str(tmp_path))
