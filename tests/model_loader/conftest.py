"""The quantized-checkpoint tests' tiny models (quantized_checks.py has the rest they share)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from tests.model_loader.quantized_checks import (
    ARCHITECTURES,
    MIXTRAL,
    QWEN3_MOE,
)


@pytest.fixture
def tiny(make_tiny_model: Callable, tmp_path: Path) -> Callable[[str], tuple[PreTrainedModel, Path]]:
    """tiny(architecture) -> (the dense HF model, a directory for its quantized checkpoint)."""

    def make(architecture: str) -> tuple[PreTrainedModel, Path]:
        config_class, overrides = {"qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL}.get(
            architecture
        ) or ARCHITECTURES[architecture]
        hf_model, _ = make_tiny_model(config_class, **overrides)
        return hf_model, tmp_path / f"quantized-{architecture}"

    return make
