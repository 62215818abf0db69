"""The worker's side of LoRA: the model's projections wrapped once, adapters in slots.

``LoRAModelManager`` wraps every projection an adapter may target (``layers.py``) when the model
is loaded with ``enable_lora``, then, each step, puts the step's adapters in slots and gives each
token its slot::

    adapter files --loader thread--> host LRU (max_cpu_loras) --copy--> slot s of every wrapper
                  (loader.py)                                          (max_loras slots)
    step: request rows -> adapter ids -> token slots -> LoRABatch (masks, or the kernels' slots
                                                      and segments) -> every wrapper

With the kernels, wrapping the model also compiles SGMV's variants for each distinct projection
(``LoRABatch.warm_up``): the profile run has no adapter, so nothing else would before a step.

The scheduler lets at most ``max_loras`` adapters into a step, so the step's adapters always fit;
a slot whose adapter the step does not use is refilled least recently used first. Every rank
makes the same choices from the same messages, so their slots agree under tensor parallelism.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.layers import LinearWithLoRA, RowParallelLinearWithLoRA, SliceWeights
from pagedllm.lora.loader import AdapterLoader
from pagedllm.lora.peft import AdapterWeights
from pagedllm.lora.punica import NO_SLOT, LoRABatch, token_lora_ids
from pagedllm.lora.request import LoRARequest

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


class LoRAModelManager:
    """Args:
    model: the loaded model (its projections are replaced in place).
    max_num_tokens: most tokens in one forward pass.
    layers: the decoder layers this rank holds (its pipeline stage's; None: all). An adapter's
        weights for other layers are another stage's to load.
    """

    def __init__(
        self,
        model: nn.Module,
        lora_config: LoRAConfig,
        hf_config: PretrainedConfig,
        max_num_tokens: int,
        device: torch.device,
        layers: range | None = None,
    ) -> None:
        self.lora_config = lora_config
        self.layers = layers
        self.hf_config = hf_config
        targets = _find_projections(model)
        if not targets:
            raise ValueError(
                f"enable_lora: {type(model).__name__} has no projection LoRA can adapt "
                "(q/k/v/o, gate/up/down)"
            )
        dtype = next(iter(targets.values()))[1].weight.dtype
        packed = getattr(model, "packed_modules_mapping", {})
        self.batch = LoRABatch(
            lora_config.max_loras,
            lora_config.max_lora_rank,
            max_num_tokens,
            {len(packed.get(name.rpartition(".")[2], ((None, None),))) for name in targets},
            dtype,
            device,
        )
        # (layer, PEFT module name) -> (wrapper, slice index)
        self.slices: dict[tuple[int, str], tuple[LinearWithLoRA, int]] = {}
        self.wrappers: list[LinearWithLoRA] = []
        for name, (layer, base) in targets.items():
            self._wrap(model, name, layer, base, packed)
        self.batch.warm_up((w.lora_a, w.lora_b, w.slice_starts) for w in self.wrappers)
        self.loader = AdapterLoader(hf_config, lora_config)
        # Adapter id -> slot, least recently used first.
        self._slot_of: OrderedDict[int, int] = OrderedDict()

    def _wrap(
        self, model: nn.Module, name: str, layer: int, base: LinearBase, packed: dict[str, tuple]
    ) -> None:
        parent_name, _, attr = name.rpartition(".")
        if base.quant_method is not None:
            raise ValueError(f"enable_lora: {name} has quantized weights; LoRA needs quantization='none'")
        if isinstance(base, RowParallelLinear):
            wrapper: LinearWithLoRA = RowParallelLinearWithLoRA(base, (None,), self.batch)
            modules = [attr]
        else:
            pieces = packed.get(attr, ((attr, None),))
            wrapper = LinearWithLoRA(base, tuple(shard for _, shard in pieces), self.batch)
            modules = [module for module, _ in pieces]
        for index, module in enumerate(modules):
            self.slices[(layer, module)] = (wrapper, index)
        self.wrappers.append(wrapper)
        setattr(model.get_submodule(parent_name), attr, wrapper)

    # --- adapters ---------------------------------------------------------------------------

    @property
    def lora_slots(self) -> dict[int, int]:
        """Adapter id -> slot, for the adapters in slots now."""
        return dict(self._slot_of)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Start reading the adapter on the loader thread (unless loaded); whether it is loaded."""
        self.loader.start(lora_request)
        loaded, _ = self.loader.states([lora_request.lora_int_id])
        return bool(loaded)

    def prepare_step(
        self,
        lora_requests: Iterable[LoRARequest | None],
        row_lora_ids: np.ndarray,
        query_start_loc: np.ndarray,
        pad_to: int,
    ) -> None:
        """Slot the step's adapters and set every token's slot.

        lora_requests: the adapters of the step's new requests; row_lora_ids: [num_reqs] each
        scheduled request's adapter id (0: none), in batch order; query_start_loc, pad_to: the
        step's CSR offsets and graph padding (``token_lora_ids``)."""
        for lora_request in lora_requests:
            if lora_request is not None:
                # Loaded already when the engine's gate let the request in; else read now.
                self.loader.start(lora_request)
        token_ids = token_lora_ids(row_lora_ids, query_start_loc, pad_to)
        ids, inverse = np.unique(token_ids, return_inverse=True)
        active = [int(i) for i in ids if i]
        if len(active) > self.lora_config.max_loras:
            raise RuntimeError(
                f"a step has {len(active)} adapters, more than max_loras={self.lora_config.max_loras}"
            )
        slots = np.array([self._activate(i, active) if i else NO_SLOT for i in ids.tolist()], dtype=np.int64)
        # A CUDA graph's batch is decodes only; else a query longer than one token is a prefill.
        has_prefill = not pad_to and len(token_ids) > len(row_lora_ids)
        self.batch.set_token_slots(slots[inverse.reshape(-1)], has_prefill)

    def prepare_capture(self) -> None:
        """Before CUDA graphs are captured: decode steps' kernels (SGMV over a grid fixed by the
        token count, BGMV below 16 tokens), over no tokens' segments, whatever the last step (the
        profile run's prefill) chose; each replay reads the buffers its step refills."""
        self.batch.set_token_slots(np.empty(0, dtype=np.int64), has_prefill=False)

    def _activate(self, lora_int_id: int, active: list[int]) -> int:
        """The slot holding the adapter, filling one (free, or the least recently used outside
        ``active``) when none does."""
        slot = self._slot_of.get(lora_int_id)
        if slot is not None:
            self._slot_of.move_to_end(lora_int_id)
            return slot
        used = set(self._slot_of.values())
        free = [s for s in range(self.lora_config.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self._slot_of if i not in active)
            slot = self._slot_of.pop(victim)
        weights = self.loader.get(lora_int_id)
        for wrapper in self.wrappers:
            wrapper.set_slot(slot, self._slices_of(wrapper, weights))
        self._slot_of[lora_int_id] = slot
        return slot

    def _on_other_stage(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is another pipeline stage's."""
        num_layers = self.hf_config.num_hidden_layers
        return self.layers is not None and layer not in self.layers and 0 <= layer < num_layers

    def _slices_of(self, wrapper: LinearWithLoRA, weights: AdapterWeights) -> list[SliceWeights]:
        slices: list[SliceWeights] = [None] * wrapper.num_slices
        for (layer, module), ab in weights.weights.items():
            owner = self.slices.get((layer, module))
            if owner is None and self._on_other_stage(layer):
                continue
            if owner is None:
                raise ValueError(f"the model has no {module} in layer {layer} for LoRA to adapt")
            if owner[0] is wrapper:
                slices[owner[1]] = ab
        return slices


def _find_projections(model: nn.Module) -> dict[str, tuple[int, LinearBase]]:
    """The decoder layers' projections by module name, with their layer index."""
    found = {}
    for name, module in model.named_modules():
        match = _LAYER.search(name)
        if match and isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            found[name] = (int(match.group(1)), module)
    return found
