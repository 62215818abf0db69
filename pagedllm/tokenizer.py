"""Tokenizers: loading from an HF directory or a GGUF file, chat templates, EOS ids."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedllm.cache_dir import cache_root, save_atomically
from pagedllm.config import ModelConfig

logger = logging.getLogger(__name__)

# Any one of these in a model directory means it ships a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

Tokenizer = PreTrainedTokenizerBase


def has_tokenizer_files(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, name)) for name in _TOKENIZER_FILES)


def get_tokenizer(model_config: ModelConfig) -> Tokenizer | None:
    """The model's tokenizer, or None when the config skips it or the model ships none.

    Without a tokenizer the engine takes prompt token ids only and returns ids with empty text
    (vLLM's ``skip_tokenizer_init``).
    """
    if model_config.skip_tokenizer_init:
        return None
    if model_config.gguf_file is not None:
        return _load_gguf_tokenizer(model_config.gguf_file)
    if model_config.tokenizer != model_config.model and not has_tokenizer_files(model_config.tokenizer):
        # A tokenizer the caller named must exist: running on token ids instead would be a surprise.
        raise ValueError(f"tokenizer {model_config.tokenizer!r} is not a directory with tokenizer files")
    if not has_tokenizer_files(model_config.tokenizer):
        logger.warning(
            "no tokenizer files in %s: running on token ids only (prompts must be token ids, outputs carry "
            "token ids and empty text)",
            model_config.tokenizer,
        )
        return None
    return AutoTokenizer.from_pretrained(model_config.tokenizer)


def _load_gguf_tokenizer(gguf_file: str) -> Tokenizer:
    """Convert the GGUF's vocabulary to a fast tokenizer once, then reuse the saved conversion.

    The conversion parses the whole file and rebuilds the BPE model (seconds); loading the saved
    tokenizer.json takes a fraction of that.
    """
    cache_dir = gguf_cache_path(gguf_file, "gguf-tokenizers")
    if os.path.isfile(os.path.join(cache_dir, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cache_dir)
    directory, name = os.path.split(os.path.abspath(gguf_file))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    save_atomically(cache_dir, tokenizer.save_pretrained, "the converted GGUF tokenizer", is_dir=True)
    return tokenizer


def gguf_cache_path(gguf_file: str, kind: str, suffix: str = "") -> str:
    """Where something derived from a GGUF file (its converted tokenizer, its config) is cached:
    ``<cache>/pagedllm/<kind>/<key><suffix>``, keyed by the file's path, size and modification
    time and by the transformers version that derived it (``PAGEDLLM_CACHE_DIR`` overrides the
    root). Nothing is created: save there with ``cache_dir.save_atomically``."""
    stat = os.stat(gguf_file)
    key = f"{os.path.abspath(gguf_file)}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}"
    return os.path.join(str(cache_root()), kind, hashlib.sha256(key.encode()).hexdigest()[:32] + suffix)


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def get_eos_token_ids(model_config: ModelConfig, tokenizer: Tokenizer | None) -> set[int]:
    """Tokens that end generation: the tokenizer's EOS, the config's and generation_config.json's."""
    eos = _as_id_set(getattr(model_config.hf_config, "eos_token_id", None))
    if tokenizer is not None:
        eos |= _as_id_set(tokenizer.eos_token_id)
    generation_config = os.path.join(model_config.model, "generation_config.json")
    if os.path.isfile(generation_config):
        with open(generation_config) as f:
            eos |= _as_id_set(json.load(f).get("eos_token_id"))
    return eos


def apply_chat_template(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
) -> list[int]:
    """Render messages with the model's chat template and tokenize the result.

    The rendered text already carries the template's special tokens, so none are added again.
    """
    if tokenizer.chat_template is None and kwargs.get("chat_template") is None:
        raise ValueError("this model's tokenizer has no chat template: use generate() with a plain prompt")
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]
