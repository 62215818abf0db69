"""The frontend's side of a pooling request: its parameters resolved against the model once
(``resolve_pooling_params``), and its pooled vector turned into what the caller asked for
(``embedding_head``: Matryoshka truncation, then L2 normalization, as vLLM's embedding head)."""

from __future__ import annotations

import dataclasses

import torch

from pagedllm.config import EngineConfig
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

# What the core runs a pooling request with: its one "sample" is the pooled vector, so it is
# scheduled until its prompt is computed and never again (the scheduler's length rule ends it).
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def resolve_pooling_params(params: PoolingParams | None, config: EngineConfig) -> PoolingParams | None:
    """A request's pooling parameters checked against the model (ValueError naming the field),
    with ``normalize`` filled in from the model's pooler config (the caller's object is not
    changed); None for a generating model's request that has none."""
    pooler_config = config.pooler_config
    if params is None and pooler_config is None:
        return None
    if pooler_config is None:
        raise ValueError(
            "embeddings need a pooling model: this engine runs with runner='generate' "
            "(start it with runner='pooling')"
        )
    params = params if params is not None else PoolingParams()
    if not isinstance(params, PoolingParams):
        raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
    params.verify(pooler_config, config.model_config.hidden_size)
    if params.normalize is None:
        params = dataclasses.replace(params, normalize=pooler_config.normalize)
    return params


def embedding_head(vector: list[float], params: PoolingParams) -> torch.Tensor:
    """The embedding of a pooled vector: its first ``dimensions`` values, L2-normalized when
    ``normalize`` (after truncation, so a truncated embedding is a unit vector too)."""
    data = torch.tensor(vector, dtype=torch.float32)
    if params.dimensions is not None:
        data = data[: params.dimensions]
    if params.normalize:
        data = torch.nn.functional.normalize(data, dim=-1)
    return data
