"""FP8 (float8_e4m3fn) arithmetic shared by the FP8 methods: quantizing activations the way each
checkpoint format implies, dequantizing weights, and quantizing a dense weight at load.

Conventions (the ones the GPU kernels compute with, and the tests' references reimplement):

* a scale ``s`` maps ``x`` to ``clamp(x / s, -448, 448)`` rounded to e4m3 (``x / s``, not
  ``x * (1 / s)``: compressed-tensors' fake quantization divides, and the CPU path must give its
  numbers bit for bit);
* a dynamic scale is ``amax(|x|) / 448`` over its span (a token, a group of a token's inputs, or
  the tensor), with a zero amax replaced by ``DYNAMIC_SCALE_FLOOR`` so that a zero row stays zero;
* block scales (``weight_block_size``) cover ``[block_n, block_k]`` tiles of ``[output, input]``,
  ragged at the edges as DeepSeek-V3's and Hugging Face's FP8 checkpoints store them.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# compressed-tensors' zero-scale guard (the float32 epsilon), used for every dynamic scale here.
DYNAMIC_SCALE_FLOOR = torch.finfo(torch.float32).eps


def quantize_dequantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x rounded through e4m3 under ``scale`` (broadcast against x), back in x's dtype. The
    arithmetic is float32's whatever x's dtype, as an FP8 kernel's: in bfloat16, ``x / scale``
    would round once more before e4m3 does (measured: +1% perplexity on the embedded model)."""
    xf, scale = x.float(), scale.float()
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (q.float() * scale).to(x.dtype)


def dynamic_scale(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """float32 ``amax(|x|) / 448`` along ``dim`` (kept, for broadcasting), over the whole tensor
    for None."""
    x = x.float()
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = amax / FP8_MAX
    return torch.where(scale == 0, torch.full_like(scale, DYNAMIC_SCALE_FLOOR), scale)


def qdq_per_token(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, K], each token quantized under its own dynamic scale."""
    return quantize_dequantize(x, dynamic_scale(x, -1))


def qdq_per_token_group(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x: [num_tokens, K], each ``group_size`` consecutive inputs of a token under their own
    dynamic scale (DeepSeek-V3's ``act_quant``; the last group may be short)."""
    num_tokens, k = x.shape
    padded = -k % group_size
    groups = torch.nn.functional.pad(x, (0, padded)).view(num_tokens, -1, group_size)
    out = quantize_dequantize(groups, dynamic_scale(groups, -1))
    return out.view(num_tokens, -1)[:, :k]


def expand_block_scale(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """scale: [ceil(N / block_n), ceil(K / block_k)] -> [N, K], each tile's scale over its tile."""
    block_n, block_k = block
    return scale.repeat_interleave(block_n, 0)[: shape[0]].repeat_interleave(block_k, 1)[:, : shape[1]]


def dequantize_weight(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """weight: e4m3 [N, K]; scale: block scales, or [N, 1] per channel -> float32 [N, K]."""
    if block is not None:
        scale = expand_block_scale(scale.float(), block, weight.shape)
    return weight.float() * scale.float()


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight [N, K] -> (e4m3 [N, K], float32 scales [N, 1]), each output row under
    ``amax(|row|) / 448`` (vLLM's online FP8, per channel)."""
    w = weight.float()
    scale = dynamic_scale(w, -1)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
