"""The recurrent-state cache of a hybrid model on one rank: its spec, read from the model class
before loading, and its tensors, bound into the linear-attention layers after.

Its memory comes out of the KV budget first: on a GPU the tensors exist before the profile run,
so the profiler counts them as in use; on the CPU ``kv_cache_memory`` pays for them
(``kv_budget_after_state``). What is left is paged blocks for the attention layers.
"""

from __future__ import annotations

import torch

from pagedllm.config import EngineConfig, state_cache_torch_dtype
from pagedllm.layers.linear_attention.state import StateCacheSpec, allocate_state_cache
from pagedllm.models import get_model_class
from pagedllm.worker.cache_engine import copy_rows


def hybrid_model_class(config: EngineConfig) -> type | None:
    """The model class when it keeps a recurrent state per request, else None."""
    model_config = config.model_config
    model_class = get_model_class(model_config.architectures, model_config.hf_config.model_type)
    return model_class if hasattr(model_class, "state_shapes") else None


def state_cache_spec(config: EngineConfig, layers: range | None = None) -> StateCacheSpec | None:
    """This rank's state cache: one slot per request the scheduler may keep (max_num_seqs), for
    the linear-attention layers among ``layers`` (its pipeline stage's; all when None). None for a
    model with no such layer, even of a hybrid family (a config whose ``layer_types`` are all
    attention): it runs as a plain transformer, prefix caching included. A pipeline stage without
    one still gets a spec (of no layers): the scheduler's slots serve every stage."""
    model_class = hybrid_model_class(config)
    if model_class is None or not config.model_config.has_recurrent_state:
        return None
    hf_config = config.model_config.hf_config
    shapes = model_class.state_shapes(hf_config, config.parallel_config.tensor_parallel_size, layers)
    cache = config.cache_config
    conv_dtype = state_cache_torch_dtype(cache.mamba_cache_dtype, config.model_config.dtype)
    ssm_dtype = state_cache_torch_dtype(cache.mamba_ssm_cache_dtype, conv_dtype)
    return StateCacheSpec(tuple(shapes), conv_dtype, ssm_dtype, config.scheduler_config.max_num_seqs)


def num_kv_cache_layers(config: EngineConfig, layers: range | None = None) -> int:
    """Layers with a paged KV cache among ``layers`` (a pipeline stage's; all when None): the
    attention layers of a hybrid model, else every layer."""
    model_class = hybrid_model_class(config)
    if model_class is None:
        return config.model_config.num_layers if layers is None else len(layers)
    return model_class.num_attention_layers(config.model_config.hf_config, layers)


class StateCache:
    """Owns the state tensors (one (conv_state, ssm_state) per linear-attention layer)."""

    def __init__(self, spec: StateCacheSpec, device: torch.device) -> None:
        self.spec = spec
        self.layers = allocate_state_cache(spec, device)

    def copy_slots(self, src_to_dst: list[tuple[int, int]]) -> None:
        """Copy whole rows, every layer's conv window and recurrent state: a fork's from its
        parent, before the step's forward pass. On the compute stream, after the step that last
        wrote the source rows."""
        copy_rows([t for tensors in self.layers for t in tensors], src_to_dst, self.layers[0][0].device)

    def bind(self, model: torch.nn.Module) -> None:
        layers = list(model.linear_attention_layers())
        assert len(layers) == len(self.layers), f"{len(layers)} layers for {len(self.layers)} states"
        for layer, (conv_state, ssm_state) in zip(layers, self.layers):
            layer.bind_state(conv_state, ssm_state)


def kv_budget_after_state(budget: int, spec: StateCacheSpec | None) -> int:
    """Bytes of a KV budget left for paged blocks once the state cache is paid for."""
    if spec is None:
        return budget
    left = budget - spec.total_bytes
    if left <= 0:
        raise ValueError(
            f"the recurrent-state cache needs {spec.total_bytes} bytes ({spec.num_slots} slots of "
            f"{spec.slot_bytes} bytes, max_num_seqs), more than the {budget} bytes it can have: lower "
            "max_num_seqs or give the cache more memory (kv_cache_memory on the CPU, "
            "gpu_memory_utilization on a GPU)"
        )
    return left
