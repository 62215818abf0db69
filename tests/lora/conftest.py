"""PEFT adapters for the LoRA tests: trained-looking (random A and B, so every adapter changes
the outputs), saved as PEFT saves them, and PEFT's merged model as the reference."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel


def save_adapter(
    hf_model: PreTrainedModel,
    directory: Path,
    rank: int,
    targets: list[str],
    alpha: float = 16.0,
    use_rslora: bool = False,
    seed: int = 0,
) -> str:
    """A PEFT LoRA adapter of ``hf_model`` with random A and B, saved to ``directory``."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora)
    peft_model = get_peft_model(copy.deepcopy(hf_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    peft_model.save_pretrained(directory)
    return str(directory)


def merged_model(hf_model: PreTrainedModel, adapter_dir: str) -> PreTrainedModel:
    """PEFT's own reading of the saved adapter, merged into a copy of the base model."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(hf_model), adapter_dir).merge_and_unload().eval()


def hf_greedy(hf_model: PreTrainedModel, prompt: list[int], max_tokens: int) -> list[int]:
    hf_model.generation_config.eos_token_id = None
    ids = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return ids[0, len(prompt) :].tolist()


def random_prompts(n: int, vocab_size: int, seed: int = 0, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture
def make_adapter(tmp_path: Path) -> Callable[..., str]:
    """make_adapter(hf_model, rank, targets, **options) -> the adapter directory."""
    count = 0

    def make(hf_model: PreTrainedModel, rank: int, targets: list[str], **options) -> str:
        nonlocal count
        count += 1
        return save_adapter(hf_model, tmp_path / f"adapter{count}", rank, targets, seed=count, **options)

    return make


@pytest.fixture
def peft_merged() -> Callable[[PreTrainedModel, str], PreTrainedModel]:
    """merged_model(hf_model, adapter_dir): PEFT's merged model."""
    return merged_model


@pytest.fixture
def greedy_reference() -> Callable[[PreTrainedModel, list[int], int], list[int]]:
    """hf_greedy(hf_model, prompt, max_tokens): HF generate's greedy tokens."""
    return hf_greedy


@pytest.fixture
def make_prompts() -> Callable[..., list[list[int]]]:
    """random_prompts(n, vocab_size, seed=0, lo=3, hi=30)."""
    return random_prompts
