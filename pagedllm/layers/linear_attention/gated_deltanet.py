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
outputs grouped by key head, which the conv reads through a column map (``conv_input_cols``) and
the gates and the norm as strided views: nothing is copied into order, no weight is permuted.
Qwen3.5's keep ``in_proj_qkv`` ([q | k | v], the conv's channel order), ``in_proj_z``,
``in_proj_b`` and ``in_proj_a`` (``split_projections``, chosen once).

Tensor parallelism splits the key heads (and the value heads they serve) across ranks: the
checkpoint's fused projections group their outputs by key head, so a contiguous split of them is
a split by head; the conv weight, whose channels are [q | k | v], is split in each part.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear, divide, load_sharded_parts
from pagedllm.layers.linear_attention.gated_delta_rule import (
    chunk_gated_delta_rule,
    gdn_gates,
    recurrent_gated_delta_rule,
)
from pagedllm.layers.linear_attention.mixer import (
    PrefillPlan,
    StatefulMixer,
    column_run,
    decode_rows,
    norm_into,
)
from pagedllm.layers.linear_attention.state import LayerStateShape
from pagedllm.layers.utils import CheckpointTensor
from pagedllm.platform import Platform

# Tokens per chunk of flash-linear-attention's chunked rule (its default), which its chunk indices
# are built for.
FLA_CHUNK_SIZE = 64


class RMSNormGated(CustomOp):
    """RMSNorm over each head's d_v features, then a SiLU gate: norm(x) * weight * silu(z)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: [num_tokens, num_v_heads, d_v]; gate: [num_tokens, num_k_heads, group, d_v] (value
        head ``kh * group + j`` at ``[:, kh, j]``, a view of the projection's output). Returns
        [num_tokens, num_v_heads * d_v] in x's dtype, written into ``out`` when given (contiguous
        rows: a slice of rows of the layer's output, ``norm_into``)."""
        return self.forward_method(x, gate, out)

    def dispatch_forward(self, platform: Platform, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        return self.forward_triton if platform.triton else self.forward_torch

    def forward_torch(
        self, x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        gate = gate.reshape(x.shape)
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        gated = ((self.weight * normed.to(x.dtype)) * F.silu(gate.float())).flatten(1)
        # copy_ rounds to out's dtype as .to() would.
        return gated.to(x.dtype) if out is None else out.copy_(gated)

    def forward_triton(
        self, x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        from pagedllm.kernels.triton.linear_attention import rms_norm_gated

        return rms_norm_gated(x.contiguous(), gate, self.weight, self.eps, out=out)


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
        self.conv_splits = (self.key_dim, self.key_dim, self.value_dim)
        if not split_projections:
            cols = self._fused_conv_columns()  # on the host
            self.conv_cols_run = column_run(cols)
            self.register_buffer("conv_input_cols", cols.to(torch.get_default_device()), persistent=False)
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
        # The recurrent state V-first, [d_v, d_k] per head: the decode kernel's rows are then
        # contiguous runs of d_k (kernels/triton/linear_attention.py), and fla's chunked rule reads
        # and writes that layout (``state_v_first``).
        self.state_shape = LayerStateShape(
            (conv_dim, conv_kernel - 1), (self.num_v_heads, head_v_dim, head_k_dim)
        )

    def _fused_conv_columns(self) -> torch.Tensor:
        """Where each conv channel ([q | k | v], heads in order) lies in in_proj_qkvz's output,
        whose columns are grouped by key head: [q (d_k) | k (d_k) | v (group d_v) | z (group d_v)]
        per head."""
        dk, per_v = self.head_k_dim, self.group * self.head_v_dim
        on_host = dict(dtype=torch.int32, device="cpu")
        head = torch.arange(self.num_k_heads, **on_host)[:, None] * (2 * dk + 2 * per_v)
        q = head + torch.arange(dk, **on_host)
        v = head + 2 * dk + torch.arange(per_v, **on_host)
        return torch.cat([q.flatten(), (q + dk).flatten(), v.flatten()])

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
        return LayerStateShape((conv_dim, config.linear_conv_kernel_dim - 1), (num_v_heads, dv, dk))

    # --- loading ----------------------------------------------------------------------------

    def _qkv_weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | str | None = None
    ) -> None:
        """A checkpoint tensor whose rows are [q | k | v] (the conv weight, [2 * key + value, 1,
        kernel]; Qwen3.5's in_proj_qkv and its scales): this rank's heads of q, of k, of v."""
        rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        load_sharded_parts(param, loaded_weight, (self.key_dim, self.key_dim, self.value_dim), rank, tp_size)

    def _head_weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | str | None = None
    ) -> None:
        rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        load_sharded_parts(param, loaded_weight, (self.num_v_heads,), rank, tp_size)

    # --- forward ----------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_tokens, hidden_size] -> same shape."""
        mixed, z, b, a = self._project(hidden_states)
        out = hidden_states.new_empty(hidden_states.shape[0], self.value_dim)
        # The recurrence's parts ([tokens, num_v_heads, dv] each) normed into one output.
        return self.out_proj(norm_into(self.norm, self.mix(mixed, (a, b)), z, out))

    def _project_fused(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [n, hidden] -> the conv's input (in_proj_qkvz's whole output, its channels where
        ``conv_input_cols`` says), z [n, num_k_heads, group, dv], b and a [n, num_k_heads, group]:
        views, no copies."""
        n, dk, dv, group = x.shape[0], self.head_k_dim, self.head_v_dim, self.group
        qkvz = self.in_proj_qkvz(x)
        z = qkvz.view(n, self.num_k_heads, -1)[..., 2 * dk + group * dv :].unflatten(-1, (group, dv))
        b, a = self.in_proj_ba(x).view(n, self.num_k_heads, 2 * group).split([group, group], -1)
        return qkvz, z, b, a

    def _project_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n, heads, group = x.shape[0], self.num_k_heads, self.group
        z = self.in_proj_z(x).view(n, heads, group, self.head_v_dim)
        b, a = (proj(x).view(n, heads, group) for proj in (self.in_proj_b, self.in_proj_a))
        return self.in_proj_qkv(x), z, b, a

    def _gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """a, b: [n, num_k_heads, group] -> g, beta [n, num_v_heads] (gdn_gates)."""
        return gdn_gates(a.flatten(1), b.flatten(1), self.A_log, self.dt_bias)

    def _step(
        self, parts: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...], state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self._split_heads(*parts)
        # The references hold S as [d_k, d_v] (the paper's orientation); the cache holds it V-first.
        out, state = recurrent_gated_delta_rule(q, k, v, *self._gates(*inputs), state.transpose(-1, -2))
        return out, state.transpose(-1, -2)

    def _chunk(
        self, parts: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...], state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self._split_heads(*parts)
        initial = None if state is None else state.transpose(-1, -2)
        out, state = chunk_gated_delta_rule(q, k, v, *self._gates(*inputs), initial)
        return out, state.transpose(-1, -2)

    def _decode_triton(
        self, mixed: torch.Tensor, inputs: list[torch.Tensor], md: AttentionMetadata
    ) -> torch.Tensor:
        """The conv and the rule's step (its gates included) as two fused kernels, each reading
        and writing the state rows in place (kernels/triton/causal_conv1d.py, linear_attention.py):
        nothing else runs between the projections and the output norm."""
        from pagedllm.kernels.triton.causal_conv1d import causal_conv1d_update
        from pagedllm.kernels.triton.linear_attention import gated_delta_rule_update

        slots, has_state = decode_rows()
        conv_out = causal_conv1d_update(
            mixed, self.conv1d.weight[:, 0], self.conv1d.bias, self.conv_state, slots, has_state,
            cols=self.conv_input_cols, cols_run=self.conv_cols_run,
        )  # fmt: skip
        q, k, v = self._split_heads(*conv_out.split(self.conv_splits, dim=-1))
        a, b = inputs
        return gated_delta_rule_update(
            q, k, v, a, b, self.A_log, self.dt_bias, self.ssm_state, slots, has_state
        )

    def _prefill_fla(
        self, parts: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...], plan: PrefillPlan
    ) -> torch.Tensor:
        """Every prefill chunk of the step in one varlen call of flash-linear-attention's chunked
        gated delta rule (the WY/UT form on the GPU; its grouped value heads read each key head
        in place), from and into the chunks' state rows."""
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
        from fla.ops.utils.index import prepare_chunk_indices

        from pagedllm.kernels.triton.linear_attention import l2_normalize_
        from pagedllm.kernels.triton.state_rows import gather_state_rows, scatter_state_rows

        g, beta = self._gates(*inputs)
        q, k, v = self._split_heads(*parts)
        # q and k normalised here, in place (the conv wrote them for this call alone), not by fla's
        # in-kernel option: its l2norm kernel is autotuned per token count, which recompiled it at
        # nearly every new prefill size (46 times in one W6 run).
        q, k = l2_normalize_(q), l2_normalize_(k)
        # The chunks' rows as fla reads its initial states: [chunks, heads, d_v, d_k] contiguous
        # (V-first), in the cache's dtype (it converts to float32 as it loads); zeros for a chunk
        # that starts its sequence, in one pass.
        initial = gather_state_rows(self.ssm_state, plan.slots, plan.has_state_device)
        chunk_indices = plan.derive(
            "fla_chunk_indices",
            lambda: prepare_chunk_indices(
                plan.query_start_loc, FLA_CHUNK_SIZE, cu_seqlens_cpu=plan.query_start_loc_cpu
            ),
        )
        out, final = fla_chunk_gated_delta_rule(
            q[None],
            k[None],
            v[None],
            g[None],
            beta[None].to(q.dtype),
            initial_state=initial,
            output_final_state=True,
            state_v_first=True,
            cu_seqlens=plan.query_start_loc,
            cu_seqlens_cpu=plan.query_start_loc_cpu,
            chunk_indices=chunk_indices,
            chunk_size=FLA_CHUNK_SIZE,
        )
        # fla's final states are float32 [chunks, heads, d_v, d_k]: rounded to the cache's dtype
        # as they are stored into the chunks' rows.
        scatter_state_rows(self.ssm_state, plan.slots, final)
        return out[0]

    def _split_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, key_dim] twice and [n, value_dim] -> q, k [n, num_k_heads, dk], v [n, num_v_heads, dv]."""
        n = q.shape[0]
        return (
            q.view(n, self.num_k_heads, self.head_k_dim),
            k.view(n, self.num_k_heads, self.head_k_dim),
            v.view(n, self.num_v_heads, self.head_v_dim),
        )


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
