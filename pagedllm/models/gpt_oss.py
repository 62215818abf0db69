"""gpt-oss (gpt-oss-20b, gpt-oss-120b), as Hugging Face transformers' ``GptOssForCausalLM``
computes it, on the Llama blocks:

* Attention with biases on q/k/v/o and a learned sink logit per head in every softmax
  (``self_attn.sinks``: the attention backends' ``sinks``), sliding-window (``sliding_window``,
  128) and full layers alternating as ``layer_types`` says, YaRN rope.
* A mixture of experts in every layer: a router with a bias, softmax over the top-k logits; experts
  with biases and a clamped SwiGLU, ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``
  with ``g = clamp(gate, max=limit)`` (``swiglu_limit``; alpha 1.702).

Expert checkpoints interleave gate and up (column ``2i`` is gate ``i``, ``2i + 1`` up ``i``) and
store ``[num_experts, in, out]``; ``GptOssForCausalLM._checkpoint_tensors`` turns them into
FusedMoE's ``[num_experts, out, in]`` with the gate rows first. The released checkpoints ship the
expert weights in MXFP4 (``*_blocks``/``*_scales``): they are dequantized at load to the model
dtype, 4x their bytes in bfloat16 (a notice says how much); no kernel reads MXFP4 yet.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.fused_moe.layer import ExpertsForward, add_shared_expert
from pagedllm.layers.fused_moe.torch_moe import fused_experts_torch
from pagedllm.layers.linear import ReplicatedLinear, narrow_shard
from pagedllm.layers.quantization.mxfp4 import MXFP4_BYTES_PER_BLOCK, dequantize_mxfp4
from pagedllm.layers.utils import CheckpointTensor, copy_weight
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.utils import read_whole
from pagedllm.platform import Platform

logger = logging.getLogger(__name__)

# The gated activation's slope (not in the config: fixed by the architecture).
SWIGLU_ALPHA = 1.702
_EXPERT_TENSOR = re.compile(
    r"^(?P<experts>.*\.mlp\.experts)\.(?P<name>gate_up_proj|down_proj)(?P<kind>_bias|_blocks|_scales|)$"
)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[num_experts, 2 * intermediate, ...] with gate i at row 2i and up i at 2i + 1 -> the gate
    rows, then the up rows (FusedMoE's layout)."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


class GptOssExperts(FusedMoE):
    """FusedMoE with expert biases and gpt-oss's clamped SwiGLU, on the torch path everywhere (the
    Triton grouped GEMM has no bias or clamp epilogue yet)."""

    # The torch path multiplies each expert's tokens in a GEMM sized by their count.
    has_batch_invariant_form = False

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,
        )
        self.limit = config.swiglu_limit
        i = self.intermediate_size_per_rank
        self.gate_up_proj_bias = nn.Parameter(torch.empty(self.num_experts, 2 * i), requires_grad=False)
        self.down_proj_bias = nn.Parameter(
            torch.empty(self.num_experts, config.hidden_size), requires_grad=False
        )
        self.gate_up_proj_bias.weight_loader = self._gate_up_bias_loader

    def dispatch_forward(self, platform: Platform, dtype: torch.dtype) -> ExpertsForward:
        self.route = self.dispatch_route(platform)  # FusedMoE's router: softmax, top-k, renormalised
        return self.forward_torch

    def forward_torch(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Under tensor parallelism the partial outputs are summed: the down bias joins one of them.
        down_bias = self.down_proj_bias if self.tp_rank == 0 else None
        routed = fused_experts_torch(
            hidden_states,
            self.gate_up_proj,
            self.down_proj,
            topk_weights,
            topk_ids,
            w13_bias=self.gate_up_proj_bias,
            w2_bias=down_bias,
            activation=self._clamped_swiglu,
        )
        return add_shared_expert(routed, shared, shared_gate)

    def _clamped_swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))

    def _gate_up_bias_loader(
        self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: object = None
    ) -> None:
        """[num_experts, 2 * intermediate], gates then ups: this rank's slice of each."""
        i = self.intermediate_size_per_rank
        for projection, piece in enumerate(read_whole(loaded).chunk(2, dim=1)):
            shard = narrow_shard(piece, 1, self.tp_rank, i, self.tp_size)
            copy_weight(param.data.narrow(1, projection * i, i), shard)


class GptOssMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = GptOssExperts(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_tokens, hidden_size] -> same shape. Softmax over the top-k logits is
        the softmax over all of them, top-k, renormalised (FusedMoE's router)."""
        return self.experts(hidden_states, self.router(hidden_states))


class GptOssForCausalLM(LlamaForCausalLM):
    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_index: int) -> nn.Module:
        return GptOssMoeBlock(config)

    def _checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, str, int | str | None, torch.Tensor]]:
        mxfp4 = _Mxfp4Dequantizer(next(self.parameters()).dtype)
        for ckpt_name, tensor in weights:
            match = _EXPERT_TENSOR.match(ckpt_name)
            if match is None:
                yield from super()._checkpoint_tensors([(ckpt_name, tensor)])
                continue
            if match["kind"] in ("_blocks", "_scales"):
                tensor = mxfp4.add(ckpt_name, match["kind"], read_whole(tensor))
                if tensor is None:  # waiting for its other half
                    continue
            else:
                tensor = read_whole(tensor)
                if match["kind"] == "":  # [num_experts, in, out] as transformers holds it
                    tensor = tensor.transpose(1, 2)
            name = f"{match['experts']}.{match['name']}{'_bias' if match['kind'] == '_bias' else ''}"
            if match["name"] == "gate_up_proj":
                tensor = _deinterleave(tensor)
            yield ckpt_name, name, None, tensor
        mxfp4.finish()


class _Mxfp4Dequantizer:
    """Pairs each expert tensor's ``_blocks`` with its ``_scales`` (they arrive one at a time, in
    any order) and dequantizes them; counts the bytes, for the notice."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.pending: dict[str, tuple[str, torch.Tensor]] = {}
        self.num_elements = 0

    def add(self, ckpt_name: str, kind: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """[num_experts, out, in] in ``dtype`` once both halves of ``ckpt_name`` are in, else None."""
        base = ckpt_name.removesuffix(kind)
        if base not in self.pending:
            self.pending[base] = (kind, tensor)
            return None
        _, other = self.pending.pop(base)
        blocks, scales = (tensor, other) if kind == "_blocks" else (other, tensor)
        try:
            weight = dequantize_mxfp4(blocks, scales, self.dtype)
        except ValueError as e:
            raise ValueError(f"cannot load MXFP4 checkpoint weight {base}: {e}") from e
        self.num_elements += weight.numel()
        return weight

    def finish(self) -> None:
        if self.pending:
            missing = ", ".join(f"{base} has {kind} only" for base, (kind, _) in self.pending.items())
            raise ValueError(f"MXFP4 checkpoint weights without their other half: {missing}")
        if self.num_elements:
            mxfp4_gib = self.num_elements / 32 * MXFP4_BYTES_PER_BLOCK / 2**30
            dequantized_gib = self.num_elements * self.dtype.itemsize / 2**30
            logger.warning(
                "gpt-oss: MXFP4 expert weights dequantized to %s at load: %.2f GiB instead of %.2f GiB "
                "as shipped (%.2f GiB more); no kernel reads MXFP4 yet",
                self.dtype,
                dequantized_gib,
                mxfp4_gib,
                dequantized_gib - mxfp4_gib,
            )
