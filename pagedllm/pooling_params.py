"""Pooling models (``runner="pooling"``): how a model's hidden states become one vector per prompt
(``PoolerConfig``, read once from the checkpoint), and what a request may ask of that vector
(``PoolingParams``, vLLM's names).

A pooling model computes its prompt and nothing else: the scheduler finishes the request when its
last prompt chunk is computed, the worker's pooler (``layers/pooler.py``) reduces the prompt's
final hidden states to one vector, and the frontend truncates it to ``dimensions`` (Matryoshka
models only) and normalizes it. Which reduction a checkpoint wants comes from sentence-
transformers' files when they are there, as vLLM reads them:

    modules.json             [{"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"},
                              {"type": "sentence_transformers.models.Normalize", ...}]
    1_Pooling/config.json    {"pooling_mode_lasttoken": true, ...}

and otherwise it is the last token, normalized: what decoder embedding models such as
Qwen3-Embedding are trained for (vLLM's default for them).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' pooling modes, in the order we prefer them when several are set.
_ST_POOLING_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolerConfig:
    """How the worker pools a prompt's hidden states and whether embeddings are normalized.

    Args:
        pooling_type: "LAST" (the last token's hidden state), "MEAN" (the mean over the prompt's
            tokens) or "CLS" (the first token's).
        normalize: divide each embedding by its L2 norm (a request's ``normalize`` overrides it).
        matryoshka_dimensions: the sizes an embedding may be truncated to (``dimensions``); None
            when the model is not Matryoshka-trained, () when any size up to the hidden size is.
    """

    pooling_type: str = "LAST"
    normalize: bool = True
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")


def load_pooler_config(model_dir: str, hf_config: Any) -> PoolerConfig:
    """The pooler a checkpoint asks for: sentence-transformers' ``modules.json`` and its pooling
    module's ``config.json`` when present, else last-token pooling, normalized."""
    pooling_type, normalize = "LAST", True
    modules = _read_json(os.path.join(model_dir, "modules.json")) if os.path.isdir(model_dir) else None
    if isinstance(modules, list):
        types = {module.get("type"): module for module in modules if isinstance(module, dict)}
        normalize = _ST_NORMALIZE in types
        pooling = types.get(_ST_POOLING)
        if pooling is not None:
            config = _read_json(os.path.join(model_dir, pooling.get("path", ""), "config.json")) or {}
            modes = [name for key, name in _ST_POOLING_MODES.items() if config.get(key)]
            if not modes:
                raise ValueError(
                    f"{model_dir}: the sentence-transformers pooling config sets none of the modes "
                    f"pagedllm runs ({', '.join(_ST_POOLING_MODES)})"
                )
            pooling_type = modes[0]
    return PoolerConfig(pooling_type, normalize, _matryoshka_dimensions(hf_config))


def _matryoshka_dimensions(hf_config: Any) -> tuple[int, ...] | None:
    """vLLM's reading of ``is_matryoshka`` / ``matryoshka_dimensions`` in the model's config."""
    dimensions = getattr(hf_config, "matryoshka_dimensions", None)
    if dimensions:
        return tuple(int(d) for d in dimensions)
    return () if getattr(hf_config, "is_matryoshka", False) else None


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


@dataclass
class PoolingParams:
    """What a pooling request asks of its embedding (vLLM's PoolingParams).

    Args:
        dimensions: keep the embedding's first ``dimensions`` values (Matryoshka truncation), then
            normalize; only for models whose config says they were trained for it.
        normalize: L2-normalize the embedding (None: the model's pooler config says).
    """

    dimensions: int | None = None
    normalize: bool | None = None

    def verify(self, pooler_config: PoolerConfig, hidden_size: int) -> None:
        """ValueError naming the field when the model cannot honour it."""
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool or None, got {self.normalize!r}")
        dimensions = self.dimensions
        if dimensions is None:
            return
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise ValueError(f"dimensions must be an int >= 1, got {dimensions!r}")
        allowed = pooler_config.matryoshka_dimensions
        if allowed is None:
            raise ValueError(
                f"dimensions={dimensions}: this model does not support Matryoshka representation "
                "(its config sets neither is_matryoshka nor matryoshka_dimensions)"
            )
        if allowed and dimensions not in allowed:
            raise ValueError(
                f"dimensions must be one of the model's matryoshka_dimensions {list(allowed)}, "
                f"got {dimensions}"
            )
        if dimensions > hidden_size:
            raise ValueError(f"dimensions must be <= the model's hidden size {hidden_size}, got {dimensions}")
