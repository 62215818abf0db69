"""Parallelism's configuration: how many ranks of each kind make one engine, how they are laid
out, and which sizes a model can be split by (refused before any weight is read)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pagedllm.config_checks import require as _require


class ModelShape(Protocol):
    """What the size checks read of a model's config (``config.ModelConfig`` has it)."""

    hf_config: Any

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def num_layers(self) -> int: ...


DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor, context and pipeline parallelism: ``pipeline_parallel_size`` stages, each a
    contiguous run of the decoder's layers, each run by ``tensor_parallel_size`` ranks holding a
    Megatron-style shard of its layers; ``context_parallel_size`` such groups share every
    sequence's KV cache, striped by token, and merge their attention (attention/context_parallel.py);
    one rank per device, ``world_size`` in all (distributed/parallel_state.py lays them out).
    ``distributed_executor_backend`` runs them: "uni" (one rank, in the engine's process), "mp"
    (one process per rank on this host) or "ray" (one Ray actor per rank, on the nodes of a Ray
    cluster). ``disable_custom_all_reduce`` sends every all-reduce through NCCL instead of the
    one-shot kernel for small messages on GPUs."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    disable_custom_all_reduce: bool = False
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.context_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank whose samples the engine reads: the last stage's first."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size * self.context_parallel_size

    def rank_layout(self, rank: int) -> tuple[int, int, int]:
        """(pipeline stage, context-parallel rank, tensor-parallel rank) of global ``rank``: stages
        outermost, tensor-parallel ranks innermost (distributed/parallel_state.py)."""
        tp, cp = self.tensor_parallel_size, self.context_parallel_size
        return rank // (tp * cp), rank // tp % cp, rank % tp

    def __post_init__(self) -> None:
        sizes = {
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "context_parallel_size": self.context_parallel_size,
        }
        for field, size in sizes.items():
            ok = isinstance(size, int) and not isinstance(size, bool) and size >= 1
            _require(ok, field, "an int >= 1", size)
        backend = self.distributed_executor_backend
        _require(
            backend in DISTRIBUTED_EXECUTOR_BACKENDS,
            "distributed_executor_backend",
            f"one of {DISTRIBUTED_EXECUTOR_BACKENDS}",
            backend,
        )
        _require(
            isinstance(self.disable_custom_all_reduce, bool),
            "disable_custom_all_reduce",
            "a bool",
            self.disable_custom_all_reduce,
        )
        if backend == "uni":
            for field, size in sizes.items():
                why = "1 with distributed_executor_backend='uni' ('mp' or 'ray' run more)"
                _require(size == 1, field, why, size)
        if self.context_parallel_size > 1:
            _require(
                self.pipeline_parallel_size == 1,
                "pipeline_parallel_size",
                f"1 with context_parallel_size={self.context_parallel_size} (stages of context-parallel "
                "groups are not supported yet)",
                self.pipeline_parallel_size,
            )

    def check_model(self, model_config: ModelShape) -> None:
        """Refuse a size that does not shard the model's heads and features evenly (before any
        weight is loaded), naming the sizes that would."""
        tp = self.tensor_parallel_size
        if tp not in _valid_tp_sizes(model_config):
            raise ValueError(
                f"tensor_parallel_size must split the model's heads and MLP evenly over the ranks "
                f"(num_attention_heads={model_config.num_attention_heads}, num_key_value_heads="
                f"{model_config.num_kv_heads}, replicated when fewer than the ranks, intermediate_size="
                f"{_intermediate_size(model_config)}): one of {_valid_tp_sizes(model_config)}, got {tp}"
            )
        pp, num_layers = self.pipeline_parallel_size, model_config.num_layers
        if pp > num_layers:
            raise ValueError(
                f"pipeline_parallel_size must give every stage at least one of the model's {num_layers} "
                f"layers: at most {num_layers}, got {pp}"
            )

    def check_draft(self, model_config: ModelShape, draft_config: ModelShape) -> None:
        """Refuse a size that does not shard the speculative draft's (or EAGLE head's) heads and
        features evenly too, naming the sizes that shard both models."""
        tp = self.tensor_parallel_size
        if tp not in _valid_tp_sizes(draft_config):
            both = sorted(set(_valid_tp_sizes(model_config)) & set(_valid_tp_sizes(draft_config)))
            raise ValueError(
                f"tensor_parallel_size must also split speculative_config.model's heads and MLP evenly "
                f"over the ranks (num_attention_heads={draft_config.num_attention_heads}, "
                f"num_key_value_heads={draft_config.num_kv_heads}, replicated when fewer than the ranks, "
                f"intermediate_size={_intermediate_size(draft_config)}): one of {both}, got {tp}"
            )


def ranks_field(pipeline_parallel_size: int, context_parallel_size: int = 1) -> str:
    """The fields whose product is the rank count: tensor_parallel_size, times
    context_parallel_size and pipeline_parallel_size where they are above 1."""
    fields = ["tensor_parallel_size"]
    if context_parallel_size > 1:
        fields.append("context_parallel_size")
    if pipeline_parallel_size > 1:
        fields.append("pipeline_parallel_size")
    return " x ".join(fields)


def _intermediate_size(model_config: ModelShape) -> int | None:
    return getattr(model_config.hf_config, "intermediate_size", None)


def _valid_tp_sizes(model_config: ModelShape) -> list[int]:
    num_heads, num_kv_heads = model_config.num_attention_heads, model_config.num_kv_heads
    intermediate_size = _intermediate_size(model_config) or num_heads
    return [
        tp
        for tp in range(1, num_heads + 1)
        if num_heads % tp == 0
        and (num_kv_heads % tp == 0 if tp <= num_kv_heads else tp % num_kv_heads == 0)
        and intermediate_size % tp == 0
    ]
