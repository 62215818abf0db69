"""What the Mamba-2 hybrids (Nemotron-H, Granite 4.0-H) share: the hybrid model's interface the
state cache reads (worker/state_cache.py), from the config's ``layer_types``: which layers have
a paged KV cache (``full_attention``), which keep a Mamba-2 state (``linear_attention``), and
that state's shape on a rank."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

from torch import nn
from transformers import PretrainedConfig

from pagedllm.layers.linear_attention.mamba2 import Mamba2Mixer, Mamba2Spec
from pagedllm.layers.linear_attention.state import LayerStateShape
from pagedllm.models.utils import CausalLM

MAMBA, ATTENTION = "linear_attention", "full_attention"


class Mamba2HybridForCausalLM(CausalLM):
    """A family sets ``mamba2_spec`` (its config's Mamba-2 sizes) and ``mixer_name`` (the
    attribute of its layers that holds the mixer, as its checkpoints name it); its layers carry
    ``block_type``, the layer's ``layer_types`` entry."""

    supports_pipeline_parallel: ClassVar[bool] = True
    mixer_name: ClassVar[str]

    @staticmethod
    def mamba2_spec(config: PretrainedConfig) -> Mamba2Spec:
        raise NotImplementedError

    @staticmethod
    def num_attention_layers(config: PretrainedConfig, layers: range | None = None) -> int:
        """Layers with a paged KV cache (among ``layers``, a pipeline stage's; all when None)."""
        kinds = config.layer_types
        return sum(kinds[i] == ATTENTION for i in (range(len(kinds)) if layers is None else layers))

    @classmethod
    def state_shapes(
        cls, config: PretrainedConfig, tp_size: int, layers: range | None = None
    ) -> list[LayerStateShape]:
        """The Mamba-2 layers' states (among ``layers``) on one of ``tp_size`` ranks (each keeps its
        heads' and groups' part)."""
        kinds = config.layer_types
        shape = Mamba2Mixer.state_shape_of(cls.mamba2_spec(config), tp_size)
        return [shape for i in (range(len(kinds)) if layers is None else layers) if kinds[i] == MAMBA]

    def linear_attention_layers(self) -> Iterator[Mamba2Mixer]:
        layers: nn.ModuleList = self.model.stage_layers
        return (getattr(layer, self.mixer_name) for layer in layers if layer.block_type == MAMBA)
