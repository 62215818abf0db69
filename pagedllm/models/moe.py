"""What the mixture-of-experts members of the Llama family share: the sparse feed-forward block
(a router and FusedMoE), and loading per-expert checkpoint tensors into the stacked weights.

Their attention and decoder layers are the Llama family's (``llama.py``); a model picks, layer by
layer, the SwiGLU MLP or this block through ``make_mlp``.
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch
from torch import nn

from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.models.llama import LlamaForCausalLM

# How many absent expert tensors an error lists before "and N more".
_MAX_LISTED = 8
# One projection of every expert in one tensor, [num_experts, ...]: GGUF's layout, named as
# transformers names it (``model.layers.0.mlp.experts.gate_proj.weight``).
_STACKED_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_STACKED_PROJECTION = re.compile(
    r"^(?P<experts>.*\.experts)\.(?P<projection>gate_proj|up_proj|down_proj)\.weight$"
)
# The tensors of one expert's projection: its weight, an FP8 checkpoint's scales, and the integer
# formats' packed weights, scales, zero points and group indices (AWQ, GPTQ, compressed-tensors).
_SUFFIXES = (
    "weight|weight_scale_inv|weight_scale|input_scale|qweight|qzeros|scales|g_idx"
    "|weight_packed|weight_zero_point|weight_shape|weight_g_idx"
)
# Our stacked expert parameters: gate_up_proj / down_proj, and <that>_<suffix> for the scales.
_EXPERT_PARAM = re.compile(r"\.experts\.(?P<param>gate_up_proj|down_proj)(?:_(?P<suffix>\w+))?$")


class SparseMoeBlock(nn.Module):
    """Router logits from a replicated linear layer (every rank routes every token the same way),
    then the experts."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        hidden_act: str,
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu' for the experts (SwiGLU), got {hidden_act!r}")
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.gate.quantizable = False  # routers stay dense in quantized checkpoints (as in vLLM)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_tokens, hidden_size] -> same shape."""
        return self.experts(hidden_states, self.gate(hidden_states))


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family model with SparseMoeBlocks; loads ``<block>.experts.<e>.<projection>.weight``
    (one expert), ``<block>.experts.<gate_proj|up_proj|down_proj>.weight`` (one projection, every
    expert) and ``<block>.experts.<gate_up_proj|down_proj>`` (the parameters whole).

    Subclasses name their checkpoint's block module (``moe_module``, ours is always ``mlp``) and
    expert projections (``expert_projections``: gate, up, down).
    """

    moe_module: ClassVar[str] = "mlp"
    expert_projections: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")

    def _param_name(self, ckpt_name: str) -> tuple[str, int | str | tuple | None]:
        ckpt_name = ckpt_name.replace(f".{self.moe_module}.", ".mlp.")
        match = self._expert_pattern().match(ckpt_name) or _STACKED_PROJECTION.match(ckpt_name)
        if match is None:
            return super()._param_name(ckpt_name)
        expert = match.groupdict().get("expert")
        gate, up, _ = self.expert_projections if expert is not None else _STACKED_PROJECTIONS
        projection = {gate: 0, up: 1}.get(match["projection"])
        param = "down_proj" if projection is None else "gate_up_proj"
        # A quantized expert's other tensors (weight_scale_inv, ...) load into <param>_<suffix>.
        suffix = match.groupdict().get("suffix") or "weight"
        param += "" if suffix == "weight" else f"_{suffix}"
        return f"{match['experts']}.{param}", (None if expert is None else int(expert), projection)

    def _describe_missing(self, name: str, loaded: set) -> str | None:
        param = _EXPERT_PARAM.search(name)
        if param is None:
            return super()._describe_missing(name, loaded)
        if None in loaded:  # the checkpoint stored the parameter whole
            return None
        experts: FusedMoE = self.get_submodule(name.rpartition(".")[0])
        gate, up, down = self.expert_projections
        shards = [(0, gate), (1, up)] if param["param"] == "gate_up_proj" else [(None, down)]
        prefix = name.rpartition(".")[0].replace(".mlp.", f".{self.moe_module}.")
        suffix = param["suffix"] or "weight"
        absent = [
            f"{prefix}.{expert}.{projection}.{suffix}"
            for expert in range(experts.num_experts)
            for shard, projection in shards
            if (expert, shard) not in loaded and (None, shard) not in loaded
        ]
        if not absent:
            return None
        more = f" and {len(absent) - _MAX_LISTED} more" if len(absent) > _MAX_LISTED else ""
        return f"{name} (num_experts={experts.num_experts}; absent: {', '.join(absent[:_MAX_LISTED])}{more})"

    def _expert_pattern(self) -> re.Pattern[str]:
        projections = "|".join(self.expert_projections)
        return re.compile(
            rf"^(?P<experts>.*\.experts)\.(?P<expert>\d+)\.(?P<projection>{projections})\.(?P<suffix>{_SUFFIXES})$"
        )
