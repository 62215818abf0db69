"""The FP8 KV cache's per-layer scales from the checkpoint (vLLM's ``k_scale`` / ``v_scale``).

FP8 checkpoints that calibrated their KV cache store one float32 scale per attention layer and
tensor, under the names their tools write:

- ``<attn>.k_scale``, ``<attn>.v_scale``: compressed-tensors (llm-compressor's
  ``kv_cache_scheme``) and vLLM's own naming;
- ``<attn>.kv_scale``: older FP8 checkpoints, one scale for both;
- ``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale``: ModelOpt;
- ``<attn>.k_proj.output_scale`` / ``<attn>.v_proj.output_scale``: compressed-tensors' output
  activation scales of the K and V projections, which are the cache's scales.

``<attn>`` is the checkpoint's attention module (``model.layers.0.self_attn``); its scales go to
the ``Attention`` layer under it (``...self_attn.attn``), filled in place into its backend's
``k_scale`` / ``v_scale`` (attention/kv_quant.py). They are per tensor, so every tensor-parallel
rank takes them whole. A layer the checkpoint gives none keeps 1.0, as in vLLM; with
``kv_cache_dtype="auto"`` the scales are loaded and unread.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.layers.utils import CheckpointSlice, CheckpointTensor

# Checkpoint name suffix -> (the number of name components naming the scale, the scales it sets).
# Longest first: ".k_proj.k_scale" also ends in ".k_scale".
_SCALE_SUFFIXES: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    (".k_proj.output_scale", 2, ("k_scale",)),
    (".v_proj.output_scale", 2, ("v_scale",)),
    (".k_proj.k_scale", 2, ("k_scale",)),
    (".v_proj.v_scale", 2, ("v_scale",)),
    (".kv_scale", 1, ("k_scale", "v_scale")),
    (".k_scale", 1, ("k_scale",)),
    (".v_scale", 1, ("v_scale",)),
)


def kv_scale_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(the checkpoint module holding the scale, the scales it sets) when checkpoint tensor
    ``name`` is a KV cache scale; None for any other tensor."""
    for suffix, num_parts, scales in _SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name.rsplit(".", num_parts)[0], scales
    return None


def load_kv_scales(
    model: nn.Module, weights: Iterable[tuple[str, CheckpointTensor]]
) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint's tensors less its KV cache scales, which are loaded into the model's
    attention layers on the way. ValueError for a scale no attention layer takes, or one that is
    not a single positive finite number."""
    # An attention layer by its parent's name: the checkpoint's attention module.
    layers = {name.rpartition(".")[0]: m for name, m in model.named_modules() if isinstance(m, Attention)}
    for name, tensor in weights:
        target = kv_scale_target(name)
        if target is None:
            yield name, tensor
            continue
        module, scales = target
        layer = layers.get(module)
        if layer is None:
            raise ValueError(
                f"checkpoint KV cache scale {name!r} matches no attention layer of {type(model).__name__}"
            )
        value = tensor.read() if isinstance(tensor, CheckpointSlice) else tensor
        if value.numel() != 1 or not (torch.isfinite(value).all() and (value > 0).all()):
            raise ValueError(
                f"checkpoint KV cache scale {name!r} must be one positive finite number (a per-tensor "
                f"scale), got shape {tuple(value.shape)}"
            )
        for scale in scales:
            getattr(layer.impl, scale).fill_(value.float().item())
