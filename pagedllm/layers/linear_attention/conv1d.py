"""The causal depthwise conv1d in front of a linear-attention layer, with its rolling window.

Each channel c of token t sees its own last ``kernel`` inputs::

    out[t, c] = bias[c] + sum_{j < kernel} weight[c, j] * x[t - kernel + 1 + j, c]

so a request's state between steps is the window of its last ``kernel - 1`` inputs,
``conv_state[c, :]`` oldest first (zeros before its first token). These are the torch
references, the oracle of any kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_prefill(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's new tokens. x: [num_tokens, channels]; weight: [channels, kernel];
    conv_state: [channels, kernel - 1] the window before them, None for a sequence's start.
    Returns (silu(conv(x)) [num_tokens, channels], the window after them [channels, kernel - 1])."""
    channels = x.shape[1]
    kernel = weight.shape[1]
    if conv_state is None:
        conv_state = x.new_zeros(channels, kernel - 1)
    window = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # [channels, kernel - 1 + num_tokens]
    out = F.conv1d(window[None], weight[:, None, :], bias, groups=channels)[0]  # [channels, num_tokens]
    return F.silu(out.t()), window[:, -(kernel - 1) :]


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    has_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token for each of a batch of sequences. x: [batch, channels]; conv_states: [batch,
    channels, kernel - 1]; has_state: [batch] bool, False for a sequence at its first token (its
    window is zeros whatever the slot holds). Returns (silu(conv(x)) [batch, channels], the new
    windows [batch, channels, kernel - 1])."""
    # A select, not a product: whatever a fresh sequence's slot holds (even NaN) must not leak in.
    conv_states = torch.where(has_state[:, None, None], conv_states.to(x.dtype), 0.0)
    window = torch.cat([conv_states, x[:, :, None]], dim=2)  # [batch, channels, kernel]
    out = (window * weight[None]).sum(dim=2)
    if bias is not None:
        out = out + bias
    return F.silu(out), window[:, :, 1:]
