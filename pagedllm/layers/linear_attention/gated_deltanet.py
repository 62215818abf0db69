"""Gated DeltaNet (Yang, Kautz and Hatamizadeh, ICLR 2025), the linear-attention layer of Qwen3-Next
and Qwen3.5, over a flattened batch of requests each with its own recurrent state.

Per token: projections to q, k (``num_k_heads`` of ``d_k``), v and an output gate z
(``num_v_heads`` of ``d_v``, each key head serving ``num_v_heads / num_k_heads`` value heads), a
write strength beta = sigmoid(b) and a decay g = -exp(A_log) * softplus(a + dt_bias) per value
head; a causal depthwise conv1d (kernel ``linear_conv_kernel_dim``, SiLU) over [q | k | v]; the
gated delta rule (gated_delta_rule.py); a gated RMSNorm per head, norm(o) * silu(z); the output
projection.

The decodes of a step run the one-token rule as a batch, each prefill chunk the chunked rule,
from and into the request's state row (mixer.py).

Qwen3-Next's checkpoints fuse the input projections as ``in_proj_qkvz`` and ``in_proj_ba``, their
outputs grouped by key head; Qwen3.5's keep ``in_proj_qkv`` ([q | k | v], the conv's channel
order), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` (``split_projections``, chosen once).

Tensor parallelism splits the key heads (and the value heads they serve) across ranks: the
checkpoint's fused projections group their outputs by key head, so a contiguous split of them is
a split by head; the conv weight, whose channels are [q | k | v], is split in each part.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear, divide, narrow_shard
from pagedllm.layers.linear_attention.gated_delta_rule import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from pagedllm.layers.linear_attention.mixer import StatefulMixer
from pagedllm.layers.linear_attention.state import LayerStateShape
from pagedllm.layers.utils import CheckpointTensor, copy_weight


class RMSNormGated(nn.Module):
    """RMSNorm over each head's d_v features, then a SiLU gate: norm(x) * weight * silu(z)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., hidden_size] -> same shape and dtype as x."""
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * normed.to(x.dtype)) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(StatefulMixer):
    has_triton_decode = True
    has_fla_prefill = True

    """Args: the config's ``hidden_size``, ``linear_num_key_heads``, ``linear_num_value_heads``,
    ``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_conv_kernel_dim`` and
    ``rms_norm_eps`` (totals over ranks: this rank keeps 1 / tensor_parallel_size of the heads);
    ``split_projections``: Qwen3.5's four input projections instead of Qwen3-Next's two.
    """

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        split_projections: bool = False,
    ) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        check_head_split(num_k_heads, num_v_heads, tp_size)
        self.num_k_heads = divide(num_k_heads, tp_size)  # this rank's
        self.num_v_heads = divide(num_v_heads, tp_size)
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.group = num_v_heads // num_k_heads  # value heads per key head
        self.key_dim = self.num_k_heads * head_k_dim
        self.value_dim = self.num_v_heads * head_v_dim
        total_key, total_value = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        if split_projections:
            self.in_proj_qkv = ColumnParallelLinear(hidden_size, 2 * total_key + total_value, bias=False)
            self.in_proj_qkv.weight.weight_loader = self._qkv_weight_loader
            self.in_proj_z = ColumnParallelLinear(hidden_size, total_value, bias=False)
            self.in_proj_b = ColumnParallelLinear(hidden_size, num_v_heads, bias=False)
            self.in_proj_a = ColumnParallelLinear(hidden_size, num_v_heads, bias=False)
            self._project = self._project_split
        else:
            self.in_proj_qkvz = ColumnParallelLinear(hidden_size, 2 * total_key + 2 * total_value, bias=False)
            self.in_proj_ba = ColumnParallelLinear(hidden_size, 2 * num_v_heads, bias=False)
            self._project = self._project_fused
        conv_dim = 2 * self.key_dim + self.value_dim
        # Its weight only ([conv_dim, 1, kernel], this rank's channels): the conv runs in conv1d.py.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim, bias=False)
        self.conv1d.weight.requires_grad_(False)
        self.conv1d.weight.weight_loader = self._qkv_weight_loader
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        for param in (self.dt_bias, self.A_log):
            param.weight_loader = self._head_weight_loader
        self.norm = RMSNormGated(head_v_dim, eps)
        self.out_proj = RowParallelLinear(total_value, hidden_size, bias=False)
        self.state_shape = LayerStateShape(
            (conv_dim, conv_kernel - 1), (self.num_v_heads, head_k_dim, head_v_dim)
        )

    @classmethod
    def from_config(cls, config: PretrainedConfig, split_projections: bool = False) -> GatedDeltaNet:
        return cls(
            config.hidden_size,
            config.linear_num_key_heads,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
            config.linear_conv_kernel_dim,
            config.rms_norm_eps,
            split_projections,
        )

    @staticmethod
    def state_shape_of(config: PretrainedConfig, tp_size: int) -> LayerStateShape:
        """The state one request keeps in such a layer on one of ``tp_size`` ranks."""
        check_head_split(config.linear_num_key_heads, config.linear_num_value_heads, tp_size)
        num_k_heads = config.linear_num_key_heads // tp_size
        num_v_heads = config.linear_num_value_heads // tp_size
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        conv_dim = 2 * num_k_heads * dk + num_v_heads * dv
        return LayerStateShape((conv_dim, config.linear_conv_kernel_dim - 1), (num_v_heads, dk, dv))

    # --- loading ----------------------------------------------------------------------------

    def _qkv_weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | str | None = None
    ) -> None:
        """A checkpoint tensor whose rows are [q | k | v] (the conv weight, [2 * key + value, 1,
        kernel]; Qwen3.5's in_proj_qkv): this rank's heads of q, of k, of v."""
        rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        key, value = self.key_dim, self.value_dim
        parts = loaded_weight.split([key * tp_size, key * tp_size, value * tp_size], dim=0)
        offset = 0
        for part, size in zip(parts, (key, key, value)):
            copy_weight(param.data[offset : offset + size], narrow_shard(part, 0, rank, size, tp_size))
            offset += size

    def _head_weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | str | None = None
    ) -> None:
        rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        copy_weight(param.data, narrow_shard(loaded_weight, 0, rank, self.num_v_heads, tp_size))

    # --- forward ----------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_tokens, hidden_size] -> same shape."""
        num_tokens = hidden_states.shape[0]
        mixed, z, b, a = self._project(hidden_states)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = self.mix(mixed, (g, beta))  # [num_tokens, num_v_heads, dv]
        out = self.norm(
            core.to(hidden_states.dtype), z.reshape(num_tokens, self.num_v_heads, self.head_v_dim)
        )
        return self.out_proj(out.reshape(num_tokens, self.value_dim))

    def _project_fused(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [n, hidden] -> mixed [n, conv_dim] ([q | k | v]), z [n, value_dim], b, a [n, heads]."""
        n, dk, dv, group = x.shape[0], self.head_k_dim, self.head_v_dim, self.group
        # Outputs grouped by key head: [q (dk) | k (dk) | v (group * dv) | z (group * dv)] each.
        q, k, v, z = (
            self.in_proj_qkvz(x).view(n, self.num_k_heads, -1).split([dk, dk, group * dv, group * dv], -1)
        )
        b, a = self.in_proj_ba(x).view(n, self.num_k_heads, -1).split([group, group], -1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], -1)
        return mixed, z.reshape(n, -1), b.reshape(n, -1), a.reshape(n, -1)

    def _project_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, conv_dim] -> q, k [n, num_k_heads, dk], v [n, num_v_heads, dv]."""
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        n = mixed.shape[0]
        return (
            q.reshape(n, self.num_k_heads, self.head_k_dim),
            k.reshape(n, self.num_k_heads, self.head_k_dim),
            v.reshape(n, self.num_v_heads, self.head_v_dim),
        )

    def _step(
        self, conv_out: torch.Tensor, inputs: tuple[torch.Tensor, ...], state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self._split_heads(conv_out)
        return recurrent_gated_delta_rule(q, k, v, *inputs, state)

    def _decode_triton(
        self, mixed: torch.Tensor, inputs: list[torch.Tensor], md: AttentionMetadata
    ) -> torch.Tensor:
        """The conv and the rule's step as two fused kernels, each reading and writing the state
        rows in place (kernels/triton/causal_conv1d.py, linear_attention.py)."""
        from pagedllm.kernels.triton.causal_conv1d import causal_conv1d_update
        from pagedllm.kernels.triton.linear_attention import gated_delta_rule_update

        n = md.num_decodes
        slots, has_state = md.state_slots[:n], md.seq_lens[:n] > 1
        conv_out = causal_conv1d_update(
            mixed, self.conv1d.weight[:, 0], self.conv1d.bias, self.conv_state, slots, has_state
        )
        q, k, v = self._split_heads(conv_out)
        return gated_delta_rule_update(q, k, v, *inputs, self.ssm_state, slots, has_state)

    def _prefill_fla(
        self,
        conv_out: torch.Tensor,
        inputs: tuple[torch.Tensor, ...],
        lengths: list[int],
        slots: torch.Tensor,
        has_state: list[bool],
    ) -> torch.Tensor:
        """Every prefill chunk of the step in one varlen call of flash-linear-attention's chunked
        gated delta rule (the WY/UT form on the GPU), from and into the chunks' state rows."""
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

        g, beta = inputs
        q, k, v = self._split_heads(conv_out)
        if self.group > 1:  # each key head serves `group` value heads
            q, k = q.repeat_interleave(self.group, dim=1), k.repeat_interleave(self.group, dim=1)
        keep = torch.tensor(has_state, device=conv_out.device)[:, None, None, None]
        initial = torch.where(keep, self.ssm_state[slots].float(), 0.0)
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], device=conv_out.device)
        out, final = fla_chunk_gated_delta_rule(
            q[None].contiguous(),
            k[None].contiguous(),
            v[None].contiguous(),
            g[None].float(),
            beta[None].to(q.dtype),
            initial_state=initial,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_seqlens,
        )
        self.ssm_state[slots] = final.to(self.ssm_state.dtype)
        return out[0].float()

    def _chunk(
        self, conv_out: torch.Tensor, inputs: tuple[torch.Tensor, ...], state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self._split_heads(conv_out)
        return chunk_gated_delta_rule(q, k, v, *inputs, state)


def check_head_split(num_k_heads: int, num_v_heads: int, tp_size: int) -> None:
    """Refuse a head count the ranks cannot split (nor the value heads their key heads)."""
    if num_v_heads % num_k_heads:
        raise ValueError(
            f"linear_num_value_heads ({num_v_heads}) must be a multiple of "
            f"linear_num_key_heads ({num_k_heads})"
        )
    if num_k_heads % tp_size:
        raise ValueError(
            f"linear_num_key_heads ({num_k_heads}) must be divisible by tensor_parallel_size ({tp_size})"
        )
