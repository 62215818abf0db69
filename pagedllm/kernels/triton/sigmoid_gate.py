"""Gated attention's output gate (Qwen3-Next; Qiu et al. 2025, "Gated Attention for Large
Language Models"): ``x * sigmoid(gate)`` per element, x the attention's output and gate the
q projection's per-head gate, in one pass.

Algorithm, elementwise with Hugging Face's rounding (``attn_output * torch.sigmoid(gate)``)::

    s   = (1 / (1 + exp(-gate))).to(dtype)       # float32 math, rounded as torch.sigmoid's output
    out = (x * s).to(dtype)                      # float32 product, rounded to the dtype

Unfused, torch writes sigmoid's output and reads it back with x: two kernels and a round trip of
the whole [tokens, heads, head_size] tensor. The division is correctly rounded (``div_rn``), as
torch's; the exponential is Triton's (``ex2.approx`` on the GPU) where torch's CUDA sigmoid calls
``expf``: their float32 sigmoids can differ in the last place, which changes the rounded
sigmoid by one ulp for about 1 element in 60,000 in bf16 (1 in 8,000 in fp16) per place of
difference; the product then differs by at most one ulp there. Elsewhere bit for bit. In float32
nothing rounds the exponential's error away: on an H200 2-3% of the elements differed, by at most
2.8 ulps.

Grid: ``(num_tokens, cdiv(num_heads, BLOCK_H))``. Each program gates a ``[BLOCK_H, BLOCK_D]``
tile: ``BLOCK_H`` heads of one token (``BLOCK_D`` is head_size rounded up to a power of two, the
padding masked).

Layouts: x and gate ``[num_tokens, num_heads, head_size]``, any token and head strides, head_size
contiguous (the gate is a view of the fused q projection's output, ``[q | gate]`` per head, read
in place); out ``[num_tokens, num_heads * head_size]`` contiguous.

Bound: memory. Bytes ``3 * num_tokens * num_heads * head_size * element_size`` (x and gate read,
out written, once); ~4 FLOPs and one exp per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.pdl import pdl_options, wait_for_prior_kernel


@triton.jit
def _sigmoid_gate_kernel(
    out_ptr,
    x_ptr,
    gate_ptr,
    num_heads,
    stride_x_tok,
    stride_x_head,
    stride_gate_tok,
    stride_gate_head,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_for_prior_kernel(USE_GDC)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    mask = (heads < num_heads)[:, None] & (cols < HEAD_SIZE)[None, :]
    dtype = x_ptr.dtype.element_ty
    x_ptrs = x_ptr + token * stride_x_tok + heads[:, None] * stride_x_head + cols[None, :]
    gate_ptrs = gate_ptr + token * stride_gate_tok + heads[:, None] * stride_gate_head + cols[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    one = tl.full(gate.shape, 1.0, tl.float32)
    sigmoid = tl.math.div_rn(one, one + tl.exp(-gate)).to(dtype).to(tl.float32)
    out_ptrs = out_ptr + token * num_heads * HEAD_SIZE + heads[:, None] * HEAD_SIZE + cols[None, :]
    tl.store(out_ptrs, (x * sigmoid).to(out_ptr.dtype.element_ty), mask=mask)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x, gate: [num_tokens, num_heads, head_size], same dtype, head_size contiguous (any other
    strides). Returns ``x * sigmoid(gate)`` as [num_tokens, num_heads * head_size], contiguous."""
    assert x.dim() == 3 and x.shape == gate.shape and x.dtype == gate.dtype, (x.shape, gate.shape)
    assert x.stride(2) == gate.stride(2) == 1, "head_size must be contiguous"
    num_tokens, num_heads, head_size = x.shape
    out = torch.empty(num_tokens, num_heads * head_size, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_d = triton.next_power_of_2(head_size)
    # Up to 2048 elements a tile: 16 per thread at the default 4 warps (16-byte vectors at 16 bits).
    block_h = min(triton.next_power_of_2(num_heads), max(1, 2048 // block_d))
    _sigmoid_gate_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        out, x, gate, num_heads, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1),
        HEAD_SIZE=head_size, BLOCK_D=block_d, BLOCK_H=block_h, **pdl_options(x.device),
    )  # fmt: skip
    return out
