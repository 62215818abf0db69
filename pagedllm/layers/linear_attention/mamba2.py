"""The Mamba-2 mixer (Dao and Gu, ICML 2024) of Mamba-2 hybrids (Nemotron-H, Granite 4.0-H), over
a flattened batch of requests each with its own state.

Per token: one input projection to [z (d_inner) | x B C (d_inner + 2 n_groups d_state) | dt
(heads)]; a causal depthwise conv1d with SiLU over x B C; the SSD recurrence (ssd.py) with dt =
softplus(dt + dt_bias) clamped to the time-step limits and A = -exp(A_log); y * silu(z),
RMS-normed per group of d_inner / n_groups; the output projection. The families' configs name
the sizes differently (``Mamba2Spec``). The state per request is the conv window
[conv_dim, kernel - 1] and h [heads, head_dim, d_state] (mixer.py runs the step's sequences). On
CUDA a decode step is two Triton kernels updating the rows in place (the conv's and the SSD's,
kernels/triton/ssd.py); the prefill's conv is the varlen kernel, its recurrence the torch chunk
scan.

Tensor parallelism splits the heads and the groups of B and C across ranks (as vLLM's
MambaMixer2 does when the groups divide the ranks): each rank projects its heads' z, x and dt and
its groups' B and C, convolves and scans them, keeps their state, and the output projection's
all-reduce sums the ranks' parts. The checkpoint's fused in_proj and conv are split part by part
(``_sharded_loader``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear, divide, load_sharded_parts
from pagedllm.layers.linear_attention.mixer import StatefulMixer, decode_rows, norm_into
from pagedllm.layers.linear_attention.ssd import ssd_chunk_scan, ssd_step
from pagedllm.layers.linear_attention.state import LayerStateShape
from pagedllm.layers.utils import CheckpointTensor


class GroupedRMSNormGated(nn.Module):
    """Mamba-2's gated norm: x * silu(z), RMS-normalised over each group of ``group_size``."""

    def __init__(self, hidden_size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: [num_tokens, heads, head_dim] (heads * head_dim = hidden_size); gate: [num_tokens,
        hidden_size]. Returns [num_tokens, hidden_size] in x's dtype, written into ``out`` when
        given (``norm_into``)."""
        x = x.flatten(1)
        gated = x.float() * F.silu(gate.float())
        groups = gated.view(*gated.shape[:-1], -1, self.group_size)
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return torch.mul(self.weight, normed.view_as(gated).to(x.dtype), out=out)


@dataclass(frozen=True)
class Mamba2Spec:
    """A Mamba-2 layer's sizes and switches, whichever names its family's config gives them
    (``heads_field`` and ``groups_field``: the config's names of the counts, for the refusals)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    chunk_size: int
    time_step_limit: tuple[float, float]
    norm_eps: float
    heads_field: str
    groups_field: str

    @classmethod
    def from_nemotron_h(cls, config: PretrainedConfig) -> Mamba2Spec:
        return cls(
            config.hidden_size, config.mamba_num_heads, config.mamba_head_dim, config.n_groups,
            config.ssm_state_size, config.conv_kernel, config.use_conv_bias, config.use_bias,
            config.chunk_size, (config.time_step_min, float("inf")), config.layer_norm_epsilon,
            "mamba_num_heads", "n_groups",
        )  # fmt: skip

    @classmethod
    def from_granite(cls, config: PretrainedConfig) -> Mamba2Spec:
        """Granite 4.0-H (GraniteMoeHybrid), Bamba."""
        low, high = config.time_step_limit
        return cls(
            config.hidden_size, config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
            config.mamba_d_state, config.mamba_d_conv, config.mamba_conv_bias, config.mamba_proj_bias,
            config.mamba_chunk_size, (float(low), float(high)), config.rms_norm_eps,
            "mamba_n_heads", "mamba_n_groups",
        )  # fmt: skip


class Mamba2Mixer(StatefulMixer):
    """A Mamba-2 layer of ``spec``'s sizes, this rank's heads and groups of it."""

    has_triton_decode = True

    def __init__(self, spec: Mamba2Spec) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        check_mamba_split(spec, tp_size)
        self.num_heads = divide(spec.num_heads, tp_size)  # this rank's
        self.n_groups = divide(spec.n_groups, tp_size)
        self.head_dim, self.state_size = spec.head_dim, spec.state_size
        self.chunk_size = spec.chunk_size
        self.time_step_limit = spec.time_step_limit
        self.d_inner = self.num_heads * self.head_dim
        group_dim = self.n_groups * self.state_size
        conv_dim = self.d_inner + 2 * group_dim
        # The checkpoint's parts, this rank's size of each: in_proj's [z | x | B | C | dt] and the
        # conv's [x | B | C].
        in_proj_parts = (self.d_inner, self.d_inner, group_dim, group_dim, self.num_heads)
        total = sum(in_proj_parts) * tp_size
        self.in_proj = ColumnParallelLinear(spec.hidden_size, total, bias=spec.proj_bias)
        # Its weight and bias only: the conv runs in conv1d.py.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, spec.conv_kernel, groups=conv_dim, bias=spec.conv_bias)
        self.conv1d.requires_grad_(False)
        self.conv_splits = (conv_dim,)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        # The norm's groups are whole on each rank: a rank's d_inner holds n_groups / tp of them.
        self.norm = GroupedRMSNormGated(
            self.d_inner, spec.num_heads * self.head_dim // spec.n_groups, spec.norm_eps
        )
        self.out_proj = RowParallelLinear(self.d_inner * tp_size, spec.hidden_size, bias=spec.proj_bias)
        for param, parts in (
            (self.in_proj.weight, in_proj_parts),
            (self.in_proj.bias, in_proj_parts),
            (self.conv1d.weight, in_proj_parts[1:4]),
            (self.conv1d.bias, in_proj_parts[1:4]),
            (self.dt_bias, (self.num_heads,)),
            (self.A_log, (self.num_heads,)),
            (self.D, (self.num_heads,)),
            (self.norm.weight, (self.d_inner,)),
        ):
            if param is not None:
                param.weight_loader = _sharded_loader(parts)
        self.state_shape = self.state_shape_of(spec, tp_size)

    @staticmethod
    def state_shape_of(spec: Mamba2Spec, tp_size: int) -> LayerStateShape:
        """The state one request keeps in such a layer on one of ``tp_size`` ranks."""
        check_mamba_split(spec, tp_size)
        heads, groups = spec.num_heads // tp_size, spec.n_groups // tp_size
        conv_dim = heads * spec.head_dim + 2 * groups * spec.state_size
        return LayerStateShape((conv_dim, spec.conv_kernel - 1), (heads, spec.head_dim, spec.state_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_tokens, hidden_size] -> same shape."""
        z, xbc, dt = self.in_proj(hidden_states).split(
            [self.d_inner, self.d_inner + 2 * self.n_groups * self.state_size, self.num_heads], dim=-1
        )
        dt = F.softplus(dt.float() + self.dt_bias).clamp(*self.time_step_limit)
        out = hidden_states.new_empty(hidden_states.shape[0], self.d_inner)
        # The recurrence's parts ([tokens, heads, head_dim] each) normed into one output.
        return self.out_proj(norm_into(self.norm, self.mix(xbc, (dt,)), z, out))

    def _split(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, conv_dim] -> x [n, heads, head_dim], B and C [n, n_groups, d_state]."""
        n, bc = conv_out.shape[0], self.n_groups * self.state_size
        x, B, C = conv_out.split([self.d_inner, bc, bc], dim=-1)
        groups = (n, self.n_groups, self.state_size)
        return x.reshape(n, self.num_heads, self.head_dim), B.reshape(groups), C.reshape(groups)

    def _A(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())

    def _step(
        self, parts: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...], state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, B, C = self._split(*parts)
        return ssd_step(x, inputs[0], self._A(), B, C, self.D, state)

    def _chunk(
        self, parts: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...], state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, B, C = self._split(*parts)
        return ssd_chunk_scan(x, inputs[0], self._A(), B, C, self.D, state, self.chunk_size)

    def _decode_triton(
        self, mixed: torch.Tensor, inputs: list[torch.Tensor], md: AttentionMetadata
    ) -> torch.Tensor:
        """The conv and the SSD step as two kernels, each reading and writing the state rows in
        place (kernels/triton/causal_conv1d.py, ssd.py); x, B and C are views of the conv's output."""
        from pagedllm.kernels.triton.causal_conv1d import causal_conv1d_update
        from pagedllm.kernels.triton.ssd import ssd_state_update

        slots, has_state = decode_rows()
        conv_out = causal_conv1d_update(
            mixed, self.conv1d.weight[:, 0], self.conv1d.bias, self.conv_state, slots, has_state
        )
        x, B, C = self._split(conv_out)
        return ssd_state_update(x, B, C, inputs[0], self.A_log, self.D, self.ssm_state, slots, has_state)


def _sharded_loader(parts: tuple[int, ...]) -> Callable[..., None]:
    """A loader for a checkpoint tensor made of ``parts`` along its first dimension (this rank's
    size of each): ``load_sharded_parts``. One part: a plain split by head."""

    def load(param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | str | None = None) -> None:
        rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        load_sharded_parts(param, loaded_weight, parts, rank, tp_size)

    return load


def check_mamba_split(spec: Mamba2Spec, tp_size: int) -> None:
    """Refuse head and group counts the ranks cannot split (nor the heads their groups)."""
    heads, groups = spec.num_heads, spec.n_groups
    if heads % groups:
        raise ValueError(f"{spec.heads_field} ({heads}) must be a multiple of {spec.groups_field} ({groups})")
    if groups % tp_size:
        raise ValueError(
            f"{spec.groups_field} ({groups}) must be divisible by tensor_parallel_size ({tp_size})"
        )
