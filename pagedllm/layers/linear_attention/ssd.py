"""Mamba-2's state space dual (SSD, Dao and Gu, "Transformers are SSMs", ICML 2024): torch
references.

Per head, with a time step dt_t > 0 and A < 0, a state h [head_dim, d_state] decays and takes
the input along B_t; the output reads it along C_t::

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        y_t = h_t C_t + D x_t

``ssd_step`` takes one token per sequence (decode). ``ssd_chunk_scan`` takes a sequence's tokens
in chunks of Q (prefill): with a_i the log decay from the chunk's start through token i and h_0
the state before it, a chunk is two matmuls and the state crosses chunks unchanged::

    y_i = sum_{j <= i} exp(a_i - a_j) (C_i . B_j) dt_j x_j + exp(a_i) h_0 C_i + D x_i
    h_Q = exp(a_Q) h_0 + sum_j exp(a_Q - a_j) dt_j x_j B_j^T

B and C have ``n_groups`` heads, each shared by ``num_heads / n_groups`` consecutive heads.
Everything runs in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _expand_groups(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., n_groups, d_state] -> [..., num_heads, d_state] float32."""
    return x.float().repeat_interleave(num_heads // x.shape[-2], dim=-2)


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence. x: [batch, heads, head_dim]; dt: [batch, heads] (after softplus);
    A, D: [heads]; B, C: [batch, n_groups, d_state]; state: [batch, heads, head_dim, d_state]
    float32. Returns (y [batch, heads, head_dim] float32, the new state)."""
    num_heads = x.shape[1]
    B, C, x, dt = _expand_groups(B, num_heads), _expand_groups(C, num_heads), x.float(), dt.float()
    decay = torch.exp(dt * A.float())[..., None, None]
    state = decay * state + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = (state @ C[..., None])[..., 0] + D.float()[:, None] * x
    return y, state


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens. x: [num_tokens, heads, head_dim]; dt: [num_tokens, heads]; A, D:
    [heads]; B, C: [num_tokens, n_groups, d_state]; initial_state: [heads, head_dim, d_state]
    float32, or None at the sequence's start. Returns (y [num_tokens, heads, head_dim] float32,
    the final state)."""
    num_tokens, num_heads, head_dim = x.shape
    B, C = _expand_groups(B, num_heads), _expand_groups(C, num_heads)
    # [heads, tokens, ...], padded to whole chunks: padding has dt = 0, so it neither decays nor
    # writes the state.
    pad = -num_tokens % chunk_size
    xs, B, C = (F.pad(t.float().transpose(0, 1), (0, 0, 0, pad)) for t in (x, B, C))
    dt_h = F.pad(dt.float().t(), (0, pad))
    num_chunks = (num_tokens + pad) // chunk_size
    xs, B, C = (t.reshape(num_heads, num_chunks, chunk_size, -1) for t in (xs, B, C))
    dt_h = dt_h.reshape(num_heads, num_chunks, chunk_size)
    log_decay = (dt_h * A.float()[:, None, None]).cumsum(dim=-1)  # a_i
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    ratio = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    scores = (C @ B.transpose(-1, -2)) * ratio  # exp(a_i - a_j) C_i . B_j, j <= i
    x_dt = xs * dt_h[..., None]
    decay = log_decay.exp()[..., None]
    to_end = (log_decay[..., -1:] - log_decay).exp()[..., None]
    state = x.new_zeros(num_heads, head_dim, B.shape[-1], dtype=torch.float32)
    if initial_state is not None:
        state = initial_state.float()
    y = torch.empty_like(xs)
    for c in range(num_chunks):
        y[:, c] = scores[:, c] @ x_dt[:, c] + decay[:, c] * (C[:, c] @ state.transpose(-1, -2))
        state = decay[:, c, -1:] * state + (to_end[:, c] * x_dt[:, c]).transpose(-1, -2) @ B[:, c]
    y = y.reshape(num_heads, -1, head_dim)[:, :num_tokens].transpose(0, 1)
    return y + D.float()[:, None] * x.float(), state
