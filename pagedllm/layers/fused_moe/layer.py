"""FusedMoE: the experts of a mixture-of-experts block as two stacked weights, and their forward.

Weights (this rank's, vLLM's layout):

* ``gate_up_proj``: [num_experts, 2 * intermediate_per_rank, hidden_size], each expert's gate
  rows then its up rows (Hugging Face transformers' fused ``gate_up_proj`` of its Experts modules);
* ``down_proj``: [num_experts, hidden_size, intermediate_per_rank].

Under tensor parallelism every rank holds every expert, sharded along the intermediate dimension
(as vLLM does): gate/up are column-parallel, down is row-parallel, and one all-reduce after the
block sums the partial outputs. HF checkpoints store one tensor per expert and projection, which
the weight loader stacks; GGUF files stack each projection over the experts, transformers'
modules stack both; the loader takes all three (see ``weight_loader``).

On CUDA the experts run the Triton grouped GEMM (``pagedllm.kernels.triton.fused_moe``) and the
router its softmax-top-k kernel (``kernels/triton/moe_routing.py``); elsewhere the torch path and
``select_experts``, which are their reference.

Where the grouped GEMM runs, a shared SwiGLU expert can instead become experts of the layer
(``absorb_shared_expert``, as SGLang's shared-experts fusion does): its width cut into ``s``
pieces of the experts' width, appended as experts ``E .. E + s - 1`` that every token takes in
slots ``top_k ..`` (weight 1, or its sigmoid gate's value, the gate then a last column of the
router's logits). Its two GEMMs, its activation and its gate's GEMM leave the step: four kernels
fewer per layer, which at decode sizes each cost a launch's few microseconds for a few MB of
weights. The split is exact: SwiGLU is column-wise in the intermediate features and the down
projection sums over them.

Otherwise a shared expert scaled by a sigmoid gate (Qwen3-Next's) may join the routed sum in ``forward``:
its output and its gate's logits go in, and the Triton path adds them in the kernel that adds the
slots (``moe_sum``) instead of three more passes over the output. Under tensor parallelism the
shared expert's output may be this rank's partial sum (its row-parallel down projection built
with ``reduce_results=False``): the term is linear in it and the gate is the same on every rank,
so the block's one all-reduce sums both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.fused_moe.router import append_shared_slots, select_experts
from pagedllm.layers.fused_moe.torch_moe import fused_experts_torch
from pagedllm.layers.linear import divide, narrow_shard
from pagedllm.layers.quantization.params import layout_of
from pagedllm.layers.utils import CheckpointSlice, CheckpointTensor, copy_weight
from pagedllm.platform import Platform

# (expert id, or None for every expert stacked; projection: 0 (gate) or 1 (up) of gate_up_proj,
# None for down_proj).
ExpertShardId = tuple[int | None, int | None]


# The experts' computation: (hidden_states, topk_weights, topk_ids, shared, shared_gate) ->
# [num_tokens, hidden_size]; the shared expert's output and gate logits are optional (None).
ExpertsForward = Callable[..., torch.Tensor]
# The router: router_logits [num_tokens, num_experts] -> (topk_weights float32, topk_ids int64).
Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class FusedMoE(CustomOp):
    """The experts of one mixture-of-experts block; ``forward_method`` is their computation,
    chosen for the device (``CustomOp``): the Triton grouped GEMM on CUDA, else the torch path;
    after ``use_batch_invariant``, the grouped GEMM's batch-invariant form. ``route``, the router,
    is chosen with it: the Triton kernel on CUDA, else ``select_experts``."""

    # Set by use_batch_invariant (batch_invariant=True), after loading.
    batch_invariant = False
    # Whether use_batch_invariant applies: a subclass with its own forward has no invariant form.
    has_batch_invariant_form = True
    # Shared experts absorbed as experts num_experts .. (absorb_shared_expert); with
    # shared_gate_in_logits, the router's logits end with their gate's column.
    num_shared_slots = 0
    shared_gate_in_logits = False

    def __init__(
        self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.intermediate_size_per_rank = divide(intermediate_size, self.tp_size)
        i = self.intermediate_size_per_rank
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, i), requires_grad=False)
        self.gate_up_proj.weight_loader = self.weight_loader
        self.down_proj.weight_loader = self.weight_loader
        self.gate_up_proj.is_down = False
        self.down_proj.is_down = True
        # Set by the model loader before loading (layers/quantization/fp8_moe.py): quantized
        # experts' tensors and the activation rounding their format implies.
        self.quant_method = None
        self.activation_qdq: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states: [num_tokens, hidden_size]; router_logits: [num_tokens, num_experts]
        (with ``shared_gate_in_logits``, then the absorbed shared expert's gate, then any columns
        the router's GEMM pads with)
        -> [num_tokens, hidden_size], reduced over the tensor-parallel ranks.

        shared, shared_gate: a shared expert's output [num_tokens, hidden_size] (this rank's
        partial sum under tensor parallelism, or the whole output at one rank) and its gate's
        logits [num_tokens, 1], or both None: ``sigmoid(shared_gate) * shared`` joins the routed
        sum before the all-reduce."""
        topk_weights, topk_ids = self.route(router_logits)
        return self.forward_routed(hidden_states, topk_weights, topk_ids, shared, shared_gate)

    def forward_routed(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The experts under a routing chosen by the caller (a grouped router,
        ``router.select_experts_grouped``). topk_weights, topk_ids: [num_tokens, top_k] (with the
        absorbed shared experts' slots, ``router.append_shared_slots``); shared, shared_gate: as
        ``forward``'s."""
        out = self.forward_method(hidden_states, topk_weights, topk_ids, shared, shared_gate)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out

    def route_torch(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference router (any device); the absorbed shared experts' slots appended."""
        if not self.num_shared_slots:
            return select_experts(router_logits, self.top_k, self.renormalize)
        e = self.num_experts
        gate = router_logits[:, e : e + 1] if self.shared_gate_in_logits else None
        topk_weights, topk_ids = select_experts(router_logits[:, :e], self.top_k, self.renormalize)
        return append_shared_slots(topk_weights, topk_ids, e, self.num_shared_slots, gate)

    def route_triton(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax and top-k in one kernel, the shared slots included: ``route_torch``'s result,
        ties to the lowest expert (it is a function of each token's row alone, so batch-invariant
        as well)."""
        from pagedllm.kernels.triton.moe_routing import topk_softmax

        logits = router_logits[:, : self.num_experts + self.shared_gate_in_logits]  # a view
        return topk_softmax(
            logits, self.top_k, self.renormalize, self.num_shared_slots, self.shared_gate_in_logits
        )

    def can_absorb_shared_expert(self, intermediate_size_per_rank: int) -> bool:
        """Whether a shared SwiGLU expert of that width (this rank's) should run as experts of this
        layer: where the grouped GEMM runs (the torch path keeps Hugging Face's separate combine and
        its rounding), with unquantized experts, its width a multiple of theirs."""
        return (
            self.forward_method in (self.forward_triton, self.forward_triton_invariant)
            and self.quant_method is None
            and intermediate_size_per_rank % self.intermediate_size_per_rank == 0
        )

    def absorb_shared_expert(self, gate_up: torch.Tensor, down: torch.Tensor, gate_in_logits: bool) -> None:
        """Append a shared expert's weights as ``s = width / intermediate_size`` experts that every
        token takes (``num_shared_slots``), after loading. gate_up: [2 * width, hidden] (this
        rank's gate rows, then its up rows: ``MergedColumnParallelLinear``'s); down: [hidden, width]
        (``RowParallelLinear``'s, whose partial sum under tensor parallelism then joins the
        experts' in their one all-reduce). gate_in_logits: the router's logits will carry the
        shared expert's sigmoid gate in column ``num_experts`` (else its weight is 1)."""
        i = self.intermediate_size_per_rank
        width, hidden = gate_up.shape[0] // 2, gate_up.shape[1]
        if width % i or down.shape != (hidden, width):
            raise ValueError(
                f"a shared expert of width {width} (down {tuple(down.shape)}) cannot run as experts "
                f"of width {i} and hidden size {hidden}"
            )
        s = width // i
        gate, up = gate_up.view(2, s, i, hidden).unbind(0)  # piece j: rows [j * i, (j + 1) * i)
        pieces_gate_up = torch.cat([gate, up], dim=1)  # [s, 2 * i, hidden]
        pieces_down = down.view(hidden, s, i).permute(1, 0, 2)  # [s, hidden, i]
        for name, pieces in (("gate_up_proj", pieces_gate_up), ("down_proj", pieces_down)):
            old = getattr(self, name)
            param = nn.Parameter(torch.cat([old.data, pieces.to(old.dtype)]), requires_grad=False)
            param.weight_loader, param.is_down = old.weight_loader, old.is_down
            setattr(self, name, param)
        self.num_shared_slots, self.shared_gate_in_logits = s, gate_in_logits

    def dispatch_route(self, platform: Platform) -> Router:
        """The router to run on ``platform``; ``dispatch_forward`` sets it as ``route`` when it
        chooses the experts' forward (at construction and on every move or cast, CustomOp)."""
        return self.route_triton if platform.triton else self.route_torch

    def dispatch_forward(self, platform: Platform, dtype: torch.dtype) -> ExpertsForward:
        self.route = self.dispatch_route(platform)
        if self.batch_invariant:
            if not platform.triton:
                raise ValueError("batch_invariant=True: the experts' invariant GEMM needs Triton on CUDA")
            return self.forward_triton_invariant
        return self.forward_triton if platform.triton else self.forward_torch

    def warm_up(self, max_num_tokens: int) -> None:
        """Compile the experts' kernels for every step of at most ``max_num_tokens`` tokens (the
        Triton path's launches differ by the pairs each expert gets; the other paths compile
        nothing)."""
        if self.forward_method == self.forward_triton:
            from pagedllm.kernels.triton.fused_moe import warm_up

            warm_up(self.gate_up_proj, self.down_proj, self.top_k + self.num_shared_slots, max_num_tokens)

    def use_batch_invariant(self) -> None:
        """Run the experts so that a token's output does not depend on its batch (on CUDA: one
        launch configuration for every batch, the slots added in order; kernels/triton/fused_moe.py)."""
        self.batch_invariant = True
        self._bind(self.device, self.dtype)

    def forward_torch(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The reference path (any device)."""
        routed = fused_experts_torch(
            hidden_states, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.activation_qdq
        )
        return add_shared_expert(routed, shared, shared_gate)

    def forward_triton(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The Triton grouped GEMM over every expert at once, the shared expert added with the
        slots."""
        from pagedllm.kernels.triton.fused_moe import fused_moe

        return fused_moe(
            hidden_states,
            self.gate_up_proj,
            self.down_proj,
            topk_weights,
            topk_ids,
            shared=shared,
            shared_gate=shared_gate,
        )

    def forward_triton_invariant(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The Triton grouped GEMM, batch-invariant (``use_batch_invariant``)."""
        from pagedllm.kernels.triton.fused_moe import fused_moe

        return fused_moe(
            hidden_states,
            self.gate_up_proj,
            self.down_proj,
            topk_weights,
            topk_ids,
            batch_invariant=True,
            shared=shared,
            shared_gate=shared_gate,
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: ExpertShardId | None = None
    ) -> None:
        """Copy this rank's slice of a checkpoint tensor into ``param``.

        shard_id: ``(expert_id, projection)`` for one expert's gate (0), up (1) or down (None)
        [intermediate, hidden] / [hidden, intermediate]; ``(None, projection)`` for that projection
        of every expert stacked ([num_experts, ...], as GGUF stores them); None for the whole
        stacked parameter (``[num_experts, 2 * intermediate, hidden]`` or ``[num_experts, hidden,
        intermediate]``, as transformers' Experts modules hold them).
        """
        is_down = param.is_down  # a down_proj tensor (its scales too), else a gate_up_proj one
        if isinstance(loaded_weight, CheckpointSlice) and (shard_id is None or shard_id[0] is None):
            # Stacked experts are read whole, then split per expert (each expert's shard then
            # narrows a tensor, not the file).
            loaded_weight = loaded_weight.read()
        if shard_id is None:
            stacked = [loaded_weight] if is_down else loaded_weight.chunk(2, dim=1)
            for projection, piece in zip([None] if is_down else [0, 1], stacked):
                self.weight_loader(param, piece, (None, projection))
            return
        expert_id, projection = shard_id
        if is_down != (projection is None) or projection not in (0, 1, None):
            raise ValueError(f"shard {shard_id!r} does not fit {'down_proj' if is_down else 'gate_up_proj'}")
        if expert_id is None:
            if loaded_weight.dim() != 3 or loaded_weight.shape[0] != self.num_experts:
                raise ValueError(
                    f"shape mismatch: stacked experts {tuple(loaded_weight.shape)} should be "
                    f"[num_experts={self.num_experts}, ...]"
                )
            for expert_id, weight in enumerate(loaded_weight):
                self.weight_loader(param, weight, (expert_id, projection))
            return
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(
                f"expert {expert_id} is out of range: the config has num_experts={self.num_experts}"
            )
        # One expert's tensor, in its layout (a weight [out, in], or its block scales).
        layout = layout_of(param)
        if is_down:  # [hidden, intermediate]: row parallel, split the input features
            dim = layout.input_dim
            if dim is None:  # a per-channel scale: the same on every rank
                copy_weight(param.data[expert_id], loaded_weight)
                return
            size = param.shape[1 + dim]
            shard = narrow_shard(loaded_weight, dim, self.tp_rank, size, self.tp_size)
            copy_weight(param.data[expert_id], shard)
        else:  # [intermediate, hidden]: column parallel, split the output features
            dim = layout.output_dim
            size = param.shape[1 + dim] // 2
            shard = narrow_shard(loaded_weight, dim, self.tp_rank, size, self.tp_size)
            copy_weight(param.data[expert_id].narrow(dim, projection * size, size), shard)


def add_shared_expert(
    routed: torch.Tensor, shared: torch.Tensor | None, shared_gate: torch.Tensor | None
) -> torch.Tensor:
    """The torch path's combine: ``routed + sigmoid(shared_gate) * shared`` in the model dtype, each
    op rounded as Hugging Face's Qwen2-MoE / Qwen3-Next blocks round them (the sigmoid, the
    product, then the sum); ``routed`` itself without a shared expert."""
    if shared is None:
        return routed
    return routed + torch.sigmoid(shared_gate) * shared
