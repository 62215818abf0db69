"""The gated delta rule (Gated DeltaNet, Yang, Kautz and Hatamizadeh, ICLR 2025): torch references.

Per head, a state S [d_k, d_v] decays, is corrected toward the new value, and is read::

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T        a_t = exp(g_t), g_t <= 0
    o_t = S_t^T q_t

``recurrent_gated_delta_rule`` takes one token per sequence (decode). ``chunk_gated_delta_rule``
takes a sequence's tokens in chunks of C (prefill): inside a chunk, with G_i the decay from the
chunk's start through token i and S_0 the state before it, the corrections u_i = beta_i (v_i -
k_i^T S_{i-1}) solve one unit lower-triangular system (the UT/WY form, Yang et al., "Parallelizing
Linear Transformers with the Delta Rule over Sequence Length", NeurIPS 2024)::

    (I + A) u = beta * (v - G * K S_0)        A_ij = beta_i (G_i / G_j) k_i . k_j   (j < i)
    o_i       = G_i S_0^T q_i + sum_{j <= i} (G_i / G_j) (q_i . k_j) u_j
    S_C       = G_C S_0 + sum_j (G_C / G_j) k_j u_j^T

so a chunk costs matmuls of C x C and C x d, and the state crosses chunks, steps and scheduler
steps unchanged. Both take q and k l2-normalised and q scaled by d_k ** -0.5 here, in float32.
"""

from __future__ import annotations

import torch


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's per-token gates from its projections' raw outputs a, b [..., num_v_heads]:
    the log-decay g = -exp(A_log) * softplus(a + dt_bias) in float32, and the write strength
    beta = sigmoid(b) in b's dtype (as Hugging Face's Qwen3-Next computes them)."""
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the normalisation of q and k)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [..., num_k_heads, d_k] -> float32, normalised, q scaled, each key head repeated for
    the value heads it serves: [..., num_v_heads, d_k]."""
    repeats = num_v_heads // q.shape[-2]
    q = l2_normalize(q.float()) * q.shape[-1] ** -0.5
    k = l2_normalize(k.float())
    if repeats > 1:
        q, k = q.repeat_interleave(repeats, dim=-2), k.repeat_interleave(repeats, dim=-2)
    return q, k


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence. q, k: [batch, num_k_heads, d_k]; v: [batch, num_v_heads, d_v];
    g, beta: [batch, num_v_heads]; state: [batch, num_v_heads, d_k, d_v] float32 (zeros for a
    sequence at its start). Returns (o [batch, num_v_heads, d_v] float32, the new state)."""
    q, k = _prepare_qk(q, k, v.shape[-2])
    state = state * g.float().exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    correction = beta.float()[..., None] * (v.float() - predicted)
    state = state + k[..., :, None] * correction[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens. q, k: [num_tokens, num_k_heads, d_k]; v: [num_tokens, num_v_heads,
    d_v]; g, beta: [num_tokens, num_v_heads]; initial_state: [num_v_heads, d_k, d_v] float32, or
    None at the sequence's start. Returns (o [num_tokens, num_v_heads, d_v] float32, final state)."""
    num_tokens, num_heads, d_v = v.shape
    q, k = _prepare_qk(q, k, num_heads)
    # [heads, tokens, ...], padded to whole chunks: padding has g = 0 (no decay) and beta = 0 (no
    # write), so the final state is the last real token's.
    pad = -num_tokens % chunk_size
    q, k, v = (torch.nn.functional.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v.float()))
    g, beta = (torch.nn.functional.pad(x.float().t(), (0, pad)) for x in (g, beta))
    num_chunks = (num_tokens + pad) // chunk_size
    q, k, v = (x.reshape(num_heads, num_chunks, chunk_size, -1) for x in (q, k, v))
    log_decay = g.reshape(num_heads, num_chunks, chunk_size).cumsum(dim=-1)  # log G_i
    beta = beta.reshape(num_heads, num_chunks, chunk_size, 1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # G_i / G_j for j <= i (zero above the diagonal, where the difference would overflow).
    ratio = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    system = (beta * (k @ k.transpose(-1, -2)) * ratio).tril(-1)
    system = system + torch.eye(chunk_size, device=q.device)  # I + A, unit lower triangular
    decay = log_decay.exp()[..., None]  # G_i
    # u = T beta v - T (beta G K) S_0, with T = (I + A)^-1: both right-hand sides solved once.
    u_values = torch.linalg.solve_triangular(system, beta * v, upper=False, unitriangular=True)
    u_keys = torch.linalg.solve_triangular(system, beta * decay * k, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * ratio  # (G_i / G_j) q_i . k_j, j <= i
    to_end = (log_decay[..., -1:] - log_decay).exp()[..., None]  # G_C / G_j
    state = q.new_zeros(num_heads, q.shape[-1], d_v) if initial_state is None else initial_state.float()
    out = torch.empty_like(v)
    for c in range(num_chunks):
        u = u_values[:, c] - u_keys[:, c] @ state
        out[:, c] = (decay[:, c] * q[:, c]) @ state + scores[:, c] @ u
        state = decay[:, c, -1:] * state + (to_end[:, c] * k[:, c]).transpose(-1, -2) @ u
    out = out.reshape(num_heads, -1, d_v)[:, :num_tokens].transpose(0, 1)
    return out, state
