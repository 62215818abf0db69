"""Typed engine configuration.

Each config is a small frozen dataclass that validates itself once, in ``__post_init__``, and
raises ``ValueError`` naming the field and the allowed range. Values derived at run time (the
number of KV blocks, EOS ids) are never written back here: they live in the runtime objects that
discover them (see ``KVCacheSpec`` in ``pagedllm/worker/cache_engine.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.config_checks import is_int as _is_int
from pagedllm.config_checks import require as _require
from pagedllm.cpu_info import cpu_has_bf16
from pagedllm.lora.config import LoRAConfig
from pagedllm.parallel_config import ParallelConfig, ranks_field
from pagedllm.pooling_params import PoolerConfig
from pagedllm.spec_config import MODEL_METHODS, SpeculativeConfig

# torch is imported where a function needs it: the CLI's parsers read this module (EngineArgs'
# defaults), and `pagedllm --help` should not wait seconds for torch.
if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

GiB = 1 << 30

# HF config keys that bound the context length, in the order vLLM reads them.
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")

ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton", "cuda")
# vLLM's names for which steps replay CUDA graphs: decode steps alone (a graph of the whole
# forward), or those plus steps with prompt tokens, in graphs cut at the attention calls
# (worker/piecewise_graph.py).
CUDAGRAPH_MODES = ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# "auto": what the checkpoint says; "gguf"/"none": GGUF's Q4 weights kept or dequantized; a
# quant_method insists on the checkpoint's (and "fp8" quantizes a dense one at load).
QUANTIZATIONS = ("auto", "gguf", "none", "fp8", "compressed-tensors", "awq", "gptq")
# vLLM's kv_cache_dtype values: "auto" stores K/V in the model dtype; "fp8" (= "fp8_e4m3") stores
# float8_e4m3fn with a per-tensor scale per layer (docs/quantization.md).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# vLLM's CacheConfig.mamba_cache_dtype / mamba_ssm_cache_dtype: what a hybrid model's per-request
# state may be stored in. Its kernels load it to float32 and round it back when they store it.
MAMBA_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    """The dtypes by the names users give them."""
    import torch

    return {
        "float32": torch.float32,
        "float": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "half": torch.float16,
    }


@dataclass(frozen=True)
class ModelConfig:
    """The model to run and how: weights location, dtype, context length.

    ``model`` is the resolved local path (an HF directory or a ``.gguf`` file); ``hf_config`` is the
    transformers config read from it (for GGUF, converted from the file's metadata).
    """

    model: str
    tokenizer: str
    hf_config: PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    gguf_file: str | None = None
    skip_tokenizer_init: bool = False
    seed: int = 0
    # "auto", "gguf" or "none": whether a GGUF's quantized linear weights stay quantized
    # (pagedllm/layers/quantization/__init__.py says when "auto" keeps them).
    quantization: str = "auto"
    # A window for every layer, overriding the checkpoint's windows (None: the checkpoint's).
    sliding_window: int | None = None
    # StreamingLLM's attention sinks: leading tokens kept past the window; generation may then run
    # past max_model_len, in bounded memory.
    attention_sinks: int = 0

    def __post_init__(self) -> None:
        _require(self.max_model_len >= 1, "max_model_len", ">= 1", self.max_model_len)
        window = self.sliding_window
        _require(
            window is None or (_is_int(window) and window >= 1),
            "sliding_window",
            "an int >= 1 or None",
            window,
        )
        if window is not None:
            _require(
                window <= self.max_model_len,
                "sliding_window",
                f"<= max_model_len ({self.max_model_len})",
                window,
            )
        sinks = self.attention_sinks
        _require(_is_int(sinks) and sinks >= 0, "attention_sinks", "an int >= 0", sinks)
        if self.attention_sinks and window is None:
            raise ValueError(
                f"attention_sinks={self.attention_sinks} needs a sliding_window: the sinks are kept beside "
                "the window's last tokens"
            )
        q = self.quantization
        _require(q in QUANTIZATIONS, "quantization", f"one of {QUANTIZATIONS}", q)
        if self.quantization == "gguf" and self.gguf_file is None and not self.model.endswith(".gguf"):
            raise ValueError(f"quantization='gguf' needs a .gguf model file, got model {self.model!r}")
        derived = derive_max_model_len(self.hf_config)
        if derived is not None:
            _require(
                self.max_model_len <= derived,
                "max_model_len",
                f"<= {derived} (the model's max_position_embeddings)",
                self.max_model_len,
            )

    @property
    def max_context_len(self) -> int | None:
        """The most tokens a sequence may reach: max_model_len, or None with attention sinks."""
        return None if self.attention_sinks else self.max_model_len

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def has_recurrent_state(self) -> bool:
        """A hybrid model: some layers keep a recurrent state per request instead of a KV cache
        (Qwen3-Next's Gated DeltaNet ``linear_attention`` layers)."""
        return "linear_attention" in (getattr(self.hf_config, "layer_types", None) or ())

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2): the cache holds one latent per token."""
        return getattr(self.hf_config, "kv_lora_rank", None) is not None

    @property
    def head_size(self) -> int:
        """The cache's head size: with MLA, one latent (kv_lora_rank + qk_rope_head_dim) per token."""
        if self.is_mla:
            return self.hf_config.kv_lora_rank + self.hf_config.qk_rope_head_dim
        head_dim = getattr(self.hf_config, "head_dim", None)
        return head_dim or self.hf_config.hidden_size // self.hf_config.num_attention_heads

    @property
    def num_attention_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        if self.is_mla:  # one latent "head", replicated on every rank
            return 1
        return getattr(self.hf_config, "num_key_value_heads", None) or self.num_attention_heads

    def num_kv_heads_per_rank(self, tp_size: int) -> int:
        # With more ranks than KV heads, each rank keeps a replica of one KV head.
        return max(1, self.num_kv_heads // tp_size)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    ``kv_cache_memory`` is the CPU device's KV budget in bytes (GPUs size the cache by profiling
    against ``gpu_memory_utilization``); ``num_kv_blocks`` overrides the sized count on any device.
    ``swap_space`` is the CPU swap area in GiB, used when a request with several sequences is
    preempted.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0
    kv_cache_memory: int = 2 * GiB
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = False
    # vLLM's CacheConfig.cache_dtype (EngineArgs.kv_cache_dtype): one of KV_CACHE_DTYPES.
    cache_dtype: str = "auto"
    # vLLM's mamba_cache_dtype and mamba_ssm_cache_dtype: a hybrid model's conv windows and
    # recurrent states, one of MAMBA_CACHE_DTYPES ("auto": the model dtype; the recurrent state's
    # "auto": mamba_cache_dtype's).
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.cache_dtype == "fp8_e5m2":
            raise ValueError(
                "kv_cache_dtype='fp8_e5m2' is not supported: the kernels store float8_e4m3fn "
                "(kv_cache_dtype='fp8' or 'fp8_e4m3')"
            )
        dtype = self.cache_dtype
        _require(dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"one of {KV_CACHE_DTYPES}", dtype)
        for field in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            value = getattr(self, field)
            _require(value in MAMBA_CACHE_DTYPES, field, f"one of {MAMBA_CACHE_DTYPES}", value)
        bs = self.block_size
        _require(bs in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size", "a power of 2 in [1, 256]", bs)
        u = self.gpu_memory_utilization
        _require(0.0 < u <= 1.0, "gpu_memory_utilization", "in (0, 1]", u)
        _require(self.swap_space >= 0, "swap_space", ">= 0 (GiB)", self.swap_space)
        _require(self.kv_cache_memory > 0, "kv_cache_memory", "> 0 (bytes)", self.kv_cache_memory)
        n = self.num_kv_blocks
        _require(n is None or n >= 1, "num_kv_blocks", "None or >= 1", n)


@dataclass(frozen=True)
class SchedulerConfig:
    """Admission limits of continuous batching.

    Every step computes at most ``max_num_batched_tokens`` tokens for at most ``max_num_seqs``
    sequences. Without chunked prefill a prompt is computed in one step, so the token budget must
    hold the longest prompt.
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = False

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            f">= max_num_seqs ({self.max_num_seqs}), so every running sequence can decode each step",
            self.max_num_batched_tokens,
        )
        if not self.enable_chunked_prefill:
            _require(
                self.max_num_batched_tokens >= self.max_model_len,
                "max_num_batched_tokens",
                f">= max_model_len ({self.max_model_len}) without chunked prefill "
                "(or enable_chunked_prefill=True)",
                self.max_num_batched_tokens,
            )


@dataclass(frozen=True)
class DeviceConfig:
    device: torch.device
    # Threads of the CPU's matmuls and attention (torch.set_num_threads); None: torch's own count.
    num_threads: int | None = None

    def __post_init__(self) -> None:
        n = self.num_threads
        _require(n is None or n >= 1, "threads", "None or >= 1", n)


@dataclass(frozen=True)
class LoadConfig:
    load_format: str = "auto"

    def __post_init__(self) -> None:
        _require(self.load_format in LOAD_FORMATS, "load_format", f"one of {LOAD_FORMATS}", self.load_format)


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    load_config: LoadConfig
    attention_backend: str = "auto"
    enforce_eager: bool = False
    cudagraph_mode: str = "FULL_DECODE_ONLY"
    # Compile one stream's decode step with torch.compile (the CPU only; worker/cpu_compile.py).
    compile_cpu_decode: bool = False
    # Schedule step N + 1 while step N runs on the device; its samples reach the host a step late.
    async_scheduling: bool = False
    speculative_config: SpeculativeConfig | None = None
    # The config of speculative_config.model (a draft model or an EAGLE head), read from its file
    # by EngineArgs once the target's is known; None with n-gram drafting or none.
    draft_model_config: ModelConfig | None = None
    # LoRA adapters per request (enable_lora), or None: no projection is wrapped.
    lora_config: LoRAConfig | None = None
    # runner="pooling": prompts in, one pooled vector each out (pooling_params.py); None: generate.
    pooler_config: PoolerConfig | None = None
    # Every kernel of a step reduces in an order fixed by the row's own data and position, so a
    # request's tokens and logprobs do not depend on its batch (docs/determinism.md). Chosen once,
    # where the worker picks its kernels; engine/batch_invariant.py refuses what cannot follow.
    batch_invariant: bool = False

    @property
    def drafts_on_worker(self) -> bool:
        """Whether the worker drafts, on the device after each step's samples (a draft model, an
        EAGLE head, or with asynchronous scheduling the n-gram lookup: worker/ngram_drafter.py),
        rather than the scheduler on the host (n-gram without it: the newest tokens are there)."""
        spec = self.speculative_config
        return spec is not None and (spec.method in MODEL_METHODS or self.async_scheduling)

    @property
    def scheduler_block_size(self) -> int:
        """Tokens per block as the scheduler counts them: with context parallelism a block id names
        one ``block_size`` block on each of the ranks, which hold every P-th of its tokens."""
        return self.cache_config.block_size * self.parallel_config.context_parallel_size

    def __post_init__(self) -> None:
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"one of {ATTENTION_BACKENDS}",
            self.attention_backend,
        )
        _require(
            self.cudagraph_mode in CUDAGRAPH_MODES,
            "cudagraph_mode",
            f"one of {CUDAGRAPH_MODES}",
            self.cudagraph_mode,
        )
        self.parallel_config.check_model(self.model_config)
        if self.cache_config.cache_dtype != "auto":
            self._check_fp8_kv_cache()
        if self.speculative_config is not None:
            if self.model_config.has_recurrent_state:
                raise ValueError(
                    "speculative_config is not supported on models with linear-attention layers: their "
                    "recurrent state cannot roll back rejected drafts"
                )
            if self.draft_model_config is not None:
                # The draft (or EAGLE head) is sharded over the target's ranks (worker/draft_model.py).
                self.parallel_config.check_draft(self.model_config, self.draft_model_config)
        if self.parallel_config.pipeline_parallel_size > 1:
            self._check_pipeline_parallel()
        if self.parallel_config.context_parallel_size > 1:
            self._check_context_parallel()
        if self.pooler_config is not None:
            # The pooler reads every prompt token's hidden state: none may come from the cache.
            _require(
                not self.cache_config.enable_prefix_caching,
                "enable_prefix_caching",
                "False with runner='pooling' (the pooler needs every prompt token's hidden state)",
                self.cache_config.enable_prefix_caching,
            )
            _require(
                self.speculative_config is None,
                "speculative_config",
                "None with runner='pooling' (a pooling model generates nothing)",
                self.speculative_config,
            )

    def _check_pipeline_parallel(self) -> None:
        """What pipeline stages cannot run with yet, refused before anything loads."""
        pp = self.parallel_config.pipeline_parallel_size
        unsupported = {
            "speculative_config": (self.speculative_config, "the drafter runs beside the whole target"),
            "pooler_config": (self.pooler_config, "the pooler reads the last stage's hidden states"),
        }
        for field, (value, why) in unsupported.items():
            _require(value is None, field, f"None with pipeline_parallel_size={pp} ({why})", value)

    def _check_context_parallel(self) -> None:
        """What a KV cache striped over context-parallel ranks cannot hold, refused before anything
        loads: state that is not per token, and attention that is not one softmax over keys."""
        cp = self.parallel_config.context_parallel_size
        model = self.model_config
        kind = "recurrent state" if model.has_recurrent_state else "latent attention (MLA)"
        refused = [
            ("speculative_config", self.speculative_config, self.speculative_config is None,
             "drafts are not split over the ranks"),
            ("model", model.model, not (model.has_recurrent_state or model.is_mla),
             f"its {kind} is not split by token"),
            ("attention_sinks", model.attention_sinks, model.attention_sinks == 0,
             "the kept sinks are not striped"),
            ("attention_backend", self.attention_backend,
             self.attention_backend in ("auto", "torch", "triton"),
             "the 'torch' and 'triton' backends attend over a striped cache"),
            ("pooler_config", self.pooler_config, self.pooler_config is None, "pooling models are not split"),
        ]  # fmt: skip
        for field, value, ok, why in refused:
            if not ok:
                raise ValueError(f"{field}={value!r} is not supported with context_parallel_size={cp}: {why}")

    def _check_fp8_kv_cache(self) -> None:
        """What an FP8 KV cache cannot run with, refused before anything loads (the attention
        backend's own refusal is the worker's: ``AttentionBackend.supports_fp8_kv_cache``)."""
        dtype = self.cache_config.cache_dtype
        if self.model_config.is_mla:
            raise ValueError(
                f"kv_cache_dtype={dtype!r} is not supported with multi-head latent attention (MLA): "
                "its cache holds a latent the FP8 kernels do not read"
            )
        _require(
            not self.batch_invariant,
            "batch_invariant",
            f"False with kv_cache_dtype={dtype!r} (the batch-invariant attention kernel reads the "
            "model dtype)",
            self.batch_invariant,
        )


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache is stored in: the model's for "auto", float8_e4m3fn for "fp8"."""
    import torch

    return model_dtype if cache_dtype == "auto" else torch.float8_e4m3fn


def state_cache_torch_dtype(name: str, auto: torch.dtype) -> torch.dtype:
    """The dtype a hybrid model's conv windows or recurrent states are stored in: ``auto`` for
    "auto", else the named one (one of MAMBA_CACHE_DTYPES)."""
    return auto if name == "auto" else _dtypes()[name]


def derive_max_model_len(hf_config: PretrainedConfig) -> int | None:
    """The longest context the model's config allows, or None when it names none."""
    for key in _MAX_LEN_KEYS:
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_device(device: str | torch.device, parallel_config: ParallelConfig | None = None) -> torch.device:
    """The device to run on, with its index when it is a GPU (CUDA's memory queries need one).

    With several ranks the type alone ("cuda" or "cpu"): rank r of the "mp" backend takes
    cuda:r, a Ray actor its own GPU; the engine's process then never creates a CUDA context.
    """
    import torch

    if parallel_config is not None and parallel_config.world_size > 1:
        return _resolve_parallel_device(device, parallel_config)
    if isinstance(device, str):
        _require(
            device in ("auto", "cpu", "cuda") or device.startswith("cuda:"),
            "device",
            "'auto', 'cpu', 'cuda' or 'cuda:N'",
            device,
        )
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} was asked for, but no CUDA device is available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _resolve_parallel_device(device: str | torch.device, parallel_config: ParallelConfig) -> torch.device:
    import torch

    world_size = parallel_config.world_size
    name = str(device)
    _require(
        name in ("auto", "cpu", "cuda"),
        "device",
        f"'auto', 'cpu' or 'cuda' with {world_size} ranks (rank r runs on cuda:r; choose the GPUs "
        "with CUDA_VISIBLE_DEVICES)",
        name,
    )
    if name == "auto":
        # Counted through NVML: torch.cuda.is_available() initializes the CUDA driver in this
        # process, after which forked ranks cannot use CUDA (torch's "poisoned fork").
        name = "cuda" if torch.cuda.device_count() > 0 else "cpu"
    # With Ray the GPUs are the cluster's, which the Ray executor counts: this host may have none.
    if name == "cuda" and parallel_config.distributed_executor_backend != "ray":
        num_gpus = torch.cuda.device_count()
        _require(
            world_size <= num_gpus,
            ranks_field(parallel_config.pipeline_parallel_size, parallel_config.context_parallel_size),
            f"<= the {num_gpus} visible CUDA devices (one rank per GPU; distributed_executor_backend='ray' "
            "spans hosts)",
            world_size,
        )
    return torch.device(name)


def resolve_dtype(dtype: str | torch.dtype, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """``auto`` on a GPU: the checkpoint's half type (bf16 if none). On the CPU: float32 for a
    float32 checkpoint (its own precision, as vLLM's CPU build does), else bfloat16 where the CPU
    has bf16 dot-product units (3-4x float32's matmul speed), float32 where it has not."""
    import torch

    dtypes = _dtypes()
    if isinstance(dtype, torch.dtype):
        _require(dtype in dtypes.values(), "dtype", f"one of {sorted(dtypes)}", dtype)
        return dtype
    # transformers 5's name; its older one is a property that warns whenever it is read.
    name = "dtype" if hasattr(hf_config, "dtype") else "torch_dtype"
    checkpoint = getattr(hf_config, name, None)
    if isinstance(checkpoint, str):
        checkpoint = dtypes.get(checkpoint)
    if dtype != "auto":
        _require(dtype in dtypes, "dtype", f"'auto' or one of {sorted(dtypes)}", dtype)
        resolved = dtypes[dtype]
    elif device.type == "cpu":
        resolved = torch.bfloat16 if checkpoint != torch.float32 and cpu_has_bf16() else torch.float32
    else:
        resolved = checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.bfloat16
    if device.type == "cpu" and resolved == torch.float16:
        raise ValueError("dtype must be float32 or bfloat16 on the CPU, got float16")
    return resolved
