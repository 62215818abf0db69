"""Tiny random decoder models for pooling tests, and HF's pooled hidden states as the oracle:
``AutoModel`` (the bare decoder, final norm included) in float32, pooled and normalized by the
test's own few lines, independent of the engine."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig, Qwen3Config

TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)

# Prompts of different lengths (token ids), so a batch mixes short and long ones.
PROMPTS = [[5, 17, 3], [9] * 40, list(range(10, 35)), [1], list(range(100, 160))]


def save_tiny_decoder(
    path: Path,
    family: str = "llama",
    pooling_mode: str | None = None,
    normalize: bool = True,
    **overrides: Any,
) -> str:
    """A tiny random decoder saved at ``path``; with ``pooling_mode`` ("lasttoken", "mean_tokens",
    "cls_token") also sentence-transformers' modules.json and pooling config."""
    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    config = config_class(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.2 if "norm" in name else 0.1
            param.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(param.shape))
    model.save_pretrained(path)
    if pooling_mode is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        if normalize:
            modules.append(
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                }
            )
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(
            json.dumps(
                {"word_embedding_dimension": TINY["hidden_size"], f"pooling_mode_{pooling_mode}": True}
            )
        )
    return str(path)


def hf_pooled(
    model_dir: str, prompts: list[list[int]], pooling: str = "LAST", normalize: bool = True
) -> list[torch.Tensor]:
    """Each prompt's final hidden states from HF's AutoModel (one prompt at a time, float32),
    pooled and optionally L2-normalized."""
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    vectors = []
    with torch.no_grad():
        for token_ids in prompts:
            hidden = model(torch.tensor([token_ids])).last_hidden_state[0]  # [len, hidden]
            vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling]
            vectors.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return vectors


@pytest.fixture(scope="session")
def tiny_decoder(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """save_tiny_decoder into a fresh session directory, made once per argument set."""
    made: dict[tuple, str] = {}

    def make(
        family: str = "llama", pooling_mode: str | None = None, normalize: bool = True, **overrides: Any
    ) -> str:
        key = (family, pooling_mode, normalize, repr(sorted(overrides.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"pool-{family}")
            made[key] = save_tiny_decoder(path, family, pooling_mode, normalize, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_embedder_with_tokenizer(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> str:
    """A tiny random Llama with the embedded model's tokenizer, for text inputs (last-token pooling)."""
    path = tmp_path_factory.mktemp("pool-tokenizer")
    save_tiny_decoder(
        path, "llama", vocab_size=len(smollm2_tokenizer), eos_token_id=smollm2_tokenizer.eos_token_id
    )
    smollm2_tokenizer.save_pretrained(path)
    return str(path)
