"""The Mamba-2 mixer (Dao and Gu, ICML 2024) of Mamba-2 hybrids (Nemotron-H), over a flattened
batch of requests each with its own state.

Per token: one input projection to [z (d_inner) | x B C (d_inner + 2 n_groups d_state) | dt
(heads)]; a causal depthwise conv1d with bias and SiLU over x B C; the SSD recurrence (ssd.py)
with dt = max(softplus(dt + dt_bias), time_step_min) and A = -exp(A_log); y * silu(z), RMS-normed
per group of d_inner / n_groups; the output projection. The state per request is the conv window
[conv_dim, kernel - 1] and h [heads, head_dim, d_state] (mixer.py runs the step's sequences).

Its projections are replicated on every rank (each rank runs the whole mixer, so the residual
stream stays replicated without an all-reduce): splitting x, B and C by head group is future work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.linear_attention.mixer import StatefulMixer
from pagedllm.layers.linear_attention.ssd import ssd_chunk_scan, ssd_step
from pagedllm.layers.linear_attention.state import LayerStateShape


class GroupedRMSNormGated(nn.Module):
    """Mamba-2's gated norm: x * silu(z), RMS-normalised over each group of ``group_size``."""

    def __init__(self, hidden_size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [num_tokens, hidden_size] -> same shape, x's dtype."""
        gated = x.float() * F.silu(gate.float())
        groups = gated.view(*gated.shape[:-1], -1, self.group_size)
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.view_as(gated).to(x.dtype)


class Mamba2Mixer(StatefulMixer):
    """Args: from the config: ``hidden_size``, ``mamba_num_heads``, ``mamba_head_dim``,
    ``n_groups``, ``ssm_state_size``, ``conv_kernel``, ``use_conv_bias``, ``use_bias``,
    ``chunk_size``, ``time_step_min``, ``layer_norm_epsilon``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.mamba_num_heads, config.mamba_head_dim
        self.n_groups, self.state_size = config.n_groups, config.ssm_state_size
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"mamba_num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups})"
            )
        self.chunk_size = config.chunk_size
        self.time_step_min = config.time_step_min
        self.d_inner = self.num_heads * self.head_dim
        conv_dim = self.d_inner + 2 * self.n_groups * self.state_size
        self.in_proj = ReplicatedLinear(
            config.hidden_size, self.d_inner + conv_dim + self.num_heads, bias=config.use_bias
        )
        # Its weight and bias only: the conv runs in conv1d.py.
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, config.conv_kernel, groups=conv_dim, bias=config.use_conv_bias
        )
        self.conv1d.requires_grad_(False)
        self.conv_splits = (conv_dim,)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.norm = GroupedRMSNormGated(
            self.d_inner, self.d_inner // self.n_groups, config.layer_norm_epsilon
        )
        self.out_proj = ReplicatedLinear(self.d_inner, config.hidden_size, bias=config.use_bias)
        self.state_shape = self.state_shape_of(config)

    @staticmethod
    def state_shape_of(config: PretrainedConfig) -> LayerStateShape:
        """The state one request keeps in such a layer (the same on every rank)."""
        d_inner = config.mamba_num_heads * config.mamba_head_dim
        conv_dim = d_inner + 2 * config.n_groups * config.ssm_state_size
        return LayerStateShape(
            (conv_dim, config.conv_kernel - 1),
            (config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size),
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_tokens, hidden_size] -> same shape."""
        z, xbc, dt = self.in_proj(hidden_states).split(
            [self.d_inner, self.d_inner + 2 * self.n_groups * self.state_size, self.num_heads], dim=-1
        )
        dt = F.softplus(dt.float() + self.dt_bias).clamp(min=self.time_step_min)
        y = self.mix(xbc, (dt,))  # [num_tokens, heads, head_dim]
        y = self.norm(y.reshape(-1, self.d_inner).to(hidden_states.dtype), z)
        return self.out_proj(y)

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
