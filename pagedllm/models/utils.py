"""What every model family shares: the engine's model interface (forward, logits, weight loading),
the pre-norm decoder's loop and its pipeline stages, and the per-layer sliding windows read from a
Hugging Face config."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.distributed import (
    get_pipeline_model_parallel_world_size,
    is_first_pipeline_stage,
    is_last_pipeline_stage,
    pipeline_stage_layers,
)
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.utils import CheckpointSlice, CheckpointTensor, default_weight_loader
from pagedllm.layers.vocab_parallel_embedding import ParallelLMHead
from pagedllm.models.kv_scales import load_kv_scales

# Hugging Face layer types (config.layer_types) and whether they attend through a window.
# Hybrid models' other layers keep no KV cache, so none slides: linear attention (Qwen3-Next's
# Gated DeltaNet, Nemotron-H's Mamba-2) and Nemotron-H's feed-forward-only layers.
_LAYER_TYPE_SLIDES = {
    "full_attention": False,
    "sliding_attention": True,
    "linear_attention": False,
    "mlp": False,
    "moe": False,
}

# Config attributes the engine sets from its own options (``sliding_window`` and
# ``attention_sinks``): a window for every layer, and StreamingLLM's sink tokens. The checkpoint's
# fields keep their meaning; these take precedence over them.
ENGINE_SLIDING_WINDOW = "engine_sliding_window"
ENGINE_ATTENTION_SINKS = "engine_attention_sinks"


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: global attention), as Hugging Face's modeling applies it.

    ``config.sliding_window`` is the window; ``config.layer_types``, where the config has it, says
    which layers use it (Gemma 2/3 alternate; Qwen2/Qwen3 configs derive it from
    ``use_sliding_window`` and ``max_window_layers``: layers ``>= max_window_layers`` slide, and
    no layer slides when ``use_sliding_window`` is off). Without ``layer_types`` every
    layer slides (Mistral). The engine's ``sliding_window`` option puts every layer in one window.
    """
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:  # SmolLM3 keeps the window when off
        window = None
    override = getattr(config, ENGINE_SLIDING_WINDOW, None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(_LAYER_TYPE_SLIDES))
        if unknown:
            raise ValueError(
                f"layer_types {unknown} are not supported; supported: {sorted(_LAYER_TYPE_SLIDES)}"
            )
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    if override is not None:
        return [override] * num_layers
    if window is None:
        return [None] * num_layers
    if window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    max_len = getattr(config, "max_position_embeddings", None)
    if max_len is not None and window > max_len:
        raise ValueError(f"sliding_window {window} is larger than max_position_embeddings {max_len}")
    if layer_types is None:
        return [window] * num_layers
    return [window if _LAYER_TYPE_SLIDES[t] else None for t in layer_types]


def kv_cache_window(config: Any) -> int | None:
    """The window behind which no layer reads the KV cache (the largest window, when every layer
    has one), so that blocks falling behind it can be freed; None when some layer is global."""
    windows = layer_sliding_windows(config)
    return None if None in windows else max(windows)


def attention_sinks(config: Any) -> int:
    """Leading tokens every layer keeps attending to past its window (0: none)."""
    return getattr(config, ENGINE_ATTENTION_SINKS, 0) or 0


def pre_norm(
    norm: nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's input norm, the previous block's residual add fused into it: returns
    (normalized input, residual stream). The residual stream is hidden_states + residual (just
    hidden_states in the first layer, residual None). hidden_states, residual: [num_tokens, hidden]."""
    if residual is None:
        return norm(hidden_states), hidden_states
    return norm(hidden_states, residual)


@dataclass
class IntermediateTensors:
    """What a pipeline stage hands the next: the last layer's block output and the residual
    stream, both [num_tokens, hidden_size] (their sum is the stream; the next stage's first norm
    fuses the add, as within a stage)."""

    hidden_states: torch.Tensor
    residual: torch.Tensor


class PPMissingLayer(nn.Identity):
    """A module that lives on another pipeline stage: no parameters, never called."""


def make_stage_layers(num_layers: int, make_layer: Callable[[int], nn.Module]) -> nn.ModuleList:
    """The decoder's layers, built for this rank's pipeline stage only (``make_layer(i)``), the
    others ``PPMissingLayer``: a layer's index, hence its name in the checkpoint, stays its own.
    With several stages the list keeps its stage's range as ``stage``."""
    stage = pipeline_stage_layers(num_layers)
    layers = nn.ModuleList(make_layer(i) if i in stage else PPMissingLayer() for i in range(num_layers))
    if len(stage) < num_layers:
        layers.stage = stage
    return layers


class DecoderModel(nn.Module):
    """A decoder whose layers defer each block's residual add to the next norm, which fuses it:
    ``layer(positions, hidden_states, residual) -> (block output, residual stream)``, the stream
    being their sum, and the final ``norm`` fuses the last add.

    A family sets ``embed_tokens``, ``layers`` and ``norm`` (and ``embed_scale``, by which the
    embeddings are multiplied: Gemma's), its layers built by ``make_stage_layers`` where the family
    supports pipeline stages. The layers read their KV caches and the step's metadata themselves
    (attention/forward_context.py).

    Under pipeline parallelism a stage runs its own layers only: the first embeds the tokens, a
    later one continues the previous stage's ``IntermediateTensors``; the last applies the final
    norm, every other returns its ``IntermediateTensors``.
    """

    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    embed_scale: float | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions: [num_tokens] int64 -> final hidden states [num_tokens,
        hidden_size] (the last stage), or this stage's ``IntermediateTensors``."""
        if intermediate_tensors is None:
            hidden_states = self.embed_tokens(input_ids)
            if self.embed_scale is not None:
                hidden_states = hidden_states * self.embed_scale
            residual = None
        else:
            hidden_states, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        for layer in self.stage_layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if isinstance(self.norm, PPMissingLayer):
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    @property
    def stage_layers(self) -> nn.ModuleList:
        """The layers this rank's pipeline stage runs (all of them with one stage); fixed when the
        layers were built, so that a step reads no process-group state."""
        stage = getattr(self.layers, "stage", None)
        return self.layers if stage is None else self.layers[stage.start : stage.stop]


class CausalLM(nn.Module):
    """The engine's model interface, shared by every family: forward over a flattened batch,
    logits of chosen rows, and loading Hugging Face-named checkpoint tensors.

    A family sets ``self.model`` (forward(input_ids, positions) -> hidden states),
    ``self.lm_head`` and ``self.logits_processor`` (``init_lm_head`` sets the usual pair), and may
    override ``_checkpoint_tensors`` to rename, transpose or split what its checkpoints store.
    """

    # Checkpoint projections that live packed in one of our parameters: packed name -> the
    # checkpoint names, in shard order, and their shard ids.
    # Whether positions enter through rotary embeddings (what attention sinks re-position).
    rotary: ClassVar[bool] = True
    packed_modules_mapping: ClassVar[dict[str, tuple[tuple[str, int | str], ...]]] = {}
    # Substrings of checkpoint names that carry nothing we load (buffers derived from the config).
    skipped_checkpoint_names: ClassVar[tuple[str, ...]] = ()

    # Whether ``model`` is a DecoderModel whose layers ``make_stage_layers`` builds (pipeline stages).
    supports_pipeline_parallel: ClassVar[bool] = False

    model: nn.Module
    lm_head: nn.Module
    logits_processor: LogitsProcessor
    tie_word_embeddings: bool = False

    def init_lm_head(self, config: Any, embed_tokens: nn.Module) -> None:
        """The LM head (the token embedding when the config ties them) and the logits processor."""
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions: [num_tokens] int64, run inside ``set_forward_context`` with the
        KV caches bound (attention/forward_context.py). Returns the final hidden states:
        [num_tokens, hidden_size]; under pipeline parallelism a stage before the last returns its
        ``IntermediateTensors``, and a stage after the first continues ``intermediate_tensors``."""
        if intermediate_tensors is None:
            return self.model(input_ids, positions)
        return self.model(input_ids, positions, intermediate_tensors)

    def keep_pipeline_stage(self) -> None:
        """Drop what this rank's pipeline stage does not run (its layers were never built): the
        embedding but on the first stage (and on the last when the LM head is tied to it), the
        final norm and the LM head but on the last. A no-op with one stage."""
        if get_pipeline_model_parallel_world_size() == 1:
            return
        first, last = is_first_pipeline_stage(), is_last_pipeline_stage()
        if not first and not (last and self.tie_word_embeddings):
            self.model.embed_tokens = PPMissingLayer()
        if not last:
            self.model.norm = PPMissingLayer()
            self.lm_head = PPMissingLayer()

    def _on_other_stage(self, name: str) -> bool:
        """Whether parameter ``name`` belongs to a module of another pipeline stage."""
        parts = name.split(".")
        for end in range(1, len(parts)):
            try:
                module = self.get_submodule(".".join(parts[:end]))
            except AttributeError:
                return False
            if isinstance(module, PPMissingLayer):
                return True
        return False

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_rows, hidden_size] -> [num_rows, vocab_size] float32."""
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named checkpoint tensors; returns the names of the loaded parameters.

        Raises ValueError for a checkpoint tensor that no parameter takes, and for a parameter (or
        a shard of a packed one) that the checkpoint never provided.
        """
        params = dict(self.named_parameters())
        loaded_shards: dict[str, set[int | str | None]] = {name: set() for name in params}
        # The KV cache scales go to the attention layers, which hold them outside the parameters.
        for ckpt_name, name, shard_id, tensor in self._checkpoint_tensors(load_kv_scales(self, weights)):
            if name not in params:
                if self._on_other_stage(name):
                    continue
                model = type(self).__name__
                raise ValueError(f"checkpoint weight {ckpt_name!r} matches no parameter of {model}")
            param = params[name]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                weight_loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"cannot load checkpoint weight {ckpt_name!r}: {e}") from e
            loaded_shards[name].add(shard_id)
        missing = [m for name in params if (m := self._describe_missing(name, loaded_shards[name]))]
        if missing:
            raise ValueError(f"the checkpoint has no weights for: {', '.join(missing)}")
        return set(params)

    def _checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, str, int | str | None, torch.Tensor]]:
        """(checkpoint name, parameter name, shard id, tensor) for each tensor to load."""
        for ckpt_name, tensor in weights:
            if not self._is_skipped(ckpt_name):
                yield ckpt_name, *self._param_name(ckpt_name), tensor

    def _is_skipped(self, ckpt_name: str) -> bool:
        # A tied checkpoint may still carry the LM head, a copy of the embedding.
        is_tied_head = self.tie_word_embeddings and ckpt_name == "lm_head.weight"
        return is_tied_head or any(s in ckpt_name for s in self.skipped_checkpoint_names)

    def _param_name(self, ckpt_name: str) -> tuple[str, int | str | None]:
        """The parameter taking checkpoint tensor ``ckpt_name``, and its shard id there."""
        for packed, sources in self.packed_modules_mapping.items():
            for source, shard_id in sources:
                if f".{source}." in ckpt_name:
                    return ckpt_name.replace(f".{source}.", f".{packed}."), shard_id
        return ckpt_name, None

    def _describe_missing(self, name: str, loaded: set[int | str | None]) -> str | None:
        """None when parameter ``name`` is fully loaded, else what it lacks."""
        for packed, sources in self.packed_modules_mapping.items():
            if f".{packed}." in name:
                if None in loaded:  # the checkpoint stored the projections already packed
                    return None
                absent = [source for source, shard_id in sources if shard_id not in loaded]
                return f"{name} (from {', '.join(absent)})" if absent else None
        return None if loaded else name


def read_whole(tensor: CheckpointTensor) -> torch.Tensor:
    """The whole checkpoint tensor, read, for a loader that rearranges it before sharding (a
    transposed Conv1D, a regrouped fused QKV)."""
    return tensor.read() if isinstance(tensor, CheckpointSlice) else tensor
