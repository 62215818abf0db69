"""Rotary position embedding (RoPE), neox style, as Hugging Face's Llama applies it.

Neox style rotates the pair ``(x[i], x[i + d/2])`` of each head by ``position * inv_freq[i]``
(GPT-J style would pair adjacent elements instead). The angles' cos and sin are computed once for
every position up to ``max_position`` and indexed by each token's position at run time, so a step
costs a gather and four multiplies.

Scaling types change ``inv_freq``: ``linear`` divides it by ``factor`` (positions are
interpolated), ``llama3`` divides the low frequencies by ``factor``, keeps the high ones and blends
in between (Llama 3.1's long-context recipe), ``yarn`` blends interpolated and extrapolated
frequencies along a linear ramp over the dimensions and scales cos and sin by an attention factor
(Peng et al. 2023, "YaRN"; the factor lives in the cached cos/sin, so every kernel that reads the
cache follows, the fused Triton rotary kernel included).

Two types change with the sequence length in Hugging Face's ``dynamic_rope_update``:

* ``dynamic`` (NTK-aware) raises the base only for sequences longer than
  ``max_position_embeddings``; the engine never attends past it (max_model_len is bounded by it,
  and with attention sinks the cache holds fewer tokens), so here it is exactly the default table.
* ``longrope`` (Phi-3's) divides the frequencies by ``short_factor`` up to
  ``original_max_position_embeddings`` and by ``long_factor`` past it, and scales cos/sin by
  ``sqrt(1 + log(factor) / log(original))``. We switch per position (the table's rows from
  ``original`` on use the long factors), as vLLM does; Hugging Face switches per forward call on
  its largest position, so the two agree whenever a prompt fits in ``original`` (its decode steps
  then switch at the same position) and differ for prompts longer than that, whose first positions
  Hugging Face also rotates with the long factors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.build import available as cpu_kernels_available
from pagedllm.layers.custom_op import CustomOp
from pagedllm.platform import Platform

# What RotaryEmbedding's implementations take and return (``RotaryEmbedding.forward``).
RotaryForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def get_rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's rope parameters as one dict with ``rope_type`` and ``rope_theta``.

    transformers 5 keeps them in ``config.rope_parameters``, one dict per layer type for models
    whose layer types rotate differently (Gemma 3: ``sliding_attention`` / ``full_attention``);
    older configs split them between ``rope_scaling`` (whose type key was once ``type``) and
    ``rope_theta``.
    """
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if getattr(config, "partial_rotary_factor", None) is not None:
        params.setdefault("partial_rotary_factor", config.partial_rotary_factor)
    return params


def _default_inv_freq(head_size: int, params: dict[str, Any]) -> torch.Tensor:
    # [head_size // 2], float32 whatever the default dtype, as the reference computes it.
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).to(torch.float32) / head_size
    return 1.0 / (params["rope_theta"] ** exponents)


def _linear_inv_freq(head_size: int, params: dict[str, Any]) -> torch.Tensor:
    return _default_inv_freq(head_size, params) / params["factor"]


def _llama3_inv_freq(head_size: int, params: dict[str, Any]) -> torch.Tensor:
    inv_freq = _default_inv_freq(head_size, params)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths longer than low_freq_wavelen barely turned within the pretraining context: scale
    # them fully. Shorter than high_freq_wavelen: keep. Between: interpolate smoothly.
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(head_size: int, params: dict[str, Any]) -> torch.Tensor:
    base, factor = params["rope_theta"], params["factor"]
    original_len = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength turns num_rotations times over the original context.
        return head_size * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    high = high + 0.001 if low == high else high  # a one-dimension ramp
    ramp = ((torch.arange(head_size // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = _default_inv_freq(head_size, params)
    # Fast dimensions (ramp 0) keep their frequency, slow ones (ramp 1) are interpolated.
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _yarn_attention_factor(params: dict[str, Any]) -> float:
    if params.get("attention_factor") is not None:
        return params["attention_factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = params["factor"], params.get("mscale"), params.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def _longrope_inv_freq(head_size: int, params: dict[str, Any], long: bool = False) -> torch.Tensor:
    factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).to(torch.float32) / head_size
    return 1.0 / (factors * params["rope_theta"] ** exponents)


def _longrope_attention_factor(params: dict[str, Any], max_position: int) -> float:
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


_INV_FREQ_FUNCTIONS: dict[str, Callable[[int, dict[str, Any]], torch.Tensor]] = {
    "default": _default_inv_freq,
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
    "yarn": _yarn_inv_freq,
    # Within max_position_embeddings (see the module docstring).
    "dynamic": _default_inv_freq,
    # The short factors; RotaryEmbedding switches to the long ones past the original length.
    "longrope": _longrope_inv_freq,
}


def check_rope_parameters(rope_parameters: dict[str, Any]) -> None:
    """ValueError naming the field for what these rotary embeddings cannot reproduce."""
    rope_type = rope_parameters["rope_type"]
    if rope_type not in _INV_FREQ_FUNCTIONS:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {sorted(_INV_FREQ_FUNCTIONS)}"
        )
    factor = rope_parameters.get("partial_rotary_factor", 1.0)
    if not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")


def compute_inv_freq(head_size: int, rope_parameters: dict[str, Any]) -> torch.Tensor:
    """[head_size // 2] float32 inverse frequencies for ``rope_parameters`` (see get_rope_parameters)."""
    check_rope_parameters(rope_parameters)
    return _INV_FREQ_FUNCTIONS[rope_parameters["rope_type"]](head_size, rope_parameters)


def attention_factor(rope_parameters: dict[str, Any], max_position: int) -> float:
    """The factor by which cos and sin are scaled (1 except for yarn and longrope)."""
    rope_type = rope_parameters["rope_type"]
    if rope_type == "yarn":
        return _yarn_attention_factor(rope_parameters)
    if rope_type == "longrope":
        return _longrope_attention_factor(rope_parameters, max_position)
    return 1.0


def compute_angles(head_size: int, max_position: int, rope_parameters: dict[str, Any]) -> torch.Tensor:
    """[max_position, head_size // 2] float32: the rotation angle of every position and pair."""
    positions = torch.arange(max_position, dtype=torch.float32)
    angles = torch.outer(positions, compute_inv_freq(head_size, rope_parameters))
    if rope_parameters["rope_type"] == "longrope":
        original = rope_parameters["original_max_position_embeddings"]
        long_inv_freq = _longrope_inv_freq(head_size, rope_parameters, long=True)
        angles[original:] = torch.outer(positions[original:], long_inv_freq)
    return angles


class RotaryEmbedding(CustomOp):
    """Rotates query and key heads by their tokens' positions.

    ``cos_sin_cache: [max_position, head_size]`` holds ``[cos | sin]`` of every position's angles,
    computed in float32 and stored in ``dtype``: the reference casts cos and sin to the activations'
    dtype before multiplying, so storing them cast gives the same numbers with no per-step cast.

    ``partial_rotary_factor`` (in ``rope_parameters``; Phi-3/Phi-4-mini, GLM-4-MoE) rotates only
    each head's first ``rotary_dim = int(head_size * factor)`` dimensions, neox style among
    themselves, and passes the rest through; the frequencies are those of a ``rotary_dim`` head, as
    Hugging Face computes them. The torch path and the Triton kernel rotate part of a head
    (``is_partial``), the C++ kernel and the kernels that fuse the rotation into a backend's cache
    write whole heads only: a model gives a partial rotation to no backend and rotates before
    attention instead.

    ``unbounded`` is for positions past ``max_position`` (attention sinks let generation run on
    with the relative distances still within it): cos and sin are then computed for each step's
    positions from float64 angles, exact however large the position, and no table is kept.
    """

    forward_only_dispatches = True

    def __init__(
        self,
        head_size: int,
        max_position: int,
        rope_parameters: dict[str, Any],
        dtype: torch.dtype,
        unbounded: bool = False,
    ) -> None:
        # Set before CustomOp.__init__, whose dispatch_forward reads is_partial.
        self.head_size = head_size
        self.rotary_dim = int(head_size * rope_parameters.get("partial_rotary_factor", 1.0))
        self.is_partial = self.rotary_dim != head_size
        super().__init__()
        # The tables below are those of a rotary_dim head.
        head_size = self.rotary_dim
        self.scale = attention_factor(rope_parameters, max_position)
        self.unbounded = unbounded
        if unbounded:
            # float64 frequencies, and per position the long ones past the original length for
            # longrope (the table's rule); angles are computed per step from these.
            inv_freq = compute_inv_freq(head_size, rope_parameters).double()
            long_inv_freq = inv_freq
            self.original_max_position = None
            if rope_parameters["rope_type"] == "longrope":
                long_inv_freq = _longrope_inv_freq(head_size, rope_parameters, long=True).double()
                self.original_max_position = rope_parameters["original_max_position_embeddings"]
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)
            cache = torch.empty(0, head_size, dtype=dtype)
        else:
            angles = compute_angles(head_size, max_position, rope_parameters)
            cache = (torch.cat((angles.cos(), angles.sin()), dim=-1) * self.scale).to(dtype)
        # Not persistent: derived from the config, so it is neither saved nor loaded.
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def cos_sin_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(table, index): the ``[cos | sin]`` rows of ``positions`` are ``table[index]`` (what an
        attention backend that rotates as it writes the cache takes)."""
        if not self.unbounded:
            return self.cos_sin_cache, positions
        positions_f64 = positions.to(torch.float64)[:, None]
        angles = positions_f64 * self.inv_freq
        if self.original_max_position is not None:
            long = positions_f64 >= self.original_max_position
            angles = torch.where(long, positions_f64 * self.long_inv_freq, angles)
        rows = (torch.cat((angles.cos(), angles.sin()), dim=-1) * self.scale).to(self.cos_sin_cache.dtype)
        return rows, torch.arange(positions.shape[0], device=positions.device)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens] int64; query: [num_tokens, num_heads * head_size]; key:
        [num_tokens, num_kv_heads * head_size]. Returns the rotated (query, key), same shapes;
        they may be query and key themselves, rotated in place (the Triton kernel does)."""
        return self.forward_method(positions, query, key)

    def dispatch_forward(self, platform: Platform, dtype: torch.dtype) -> RotaryForward:
        if platform.triton:
            return self.forward_triton
        if self.is_partial:
            return self.forward_torch
        if platform.cpu_kernels and cpu_kernels_available():
            return self.forward_cpu
        return self.forward_torch

    def forward_cpu(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The C++ kernel (kernels/cpu/csrc/rotary.cpp), in place: one call instead of ~24
        operators, with the reference's rounding. The torch path instead for what the kernel does
        not read (elements strided apart, activations in another dtype than the table), and inside
        torch.compile's graphs (cpu_compile), where inductor fuses the rotation itself."""
        if (
            torch.compiler.is_compiling()
            or not query.stride(-1) == key.stride(-1) == 1
            or not query.dtype == key.dtype == self.cos_sin_cache.dtype
        ):
            return self.forward_torch(positions, query, key)
        table, index = self.cos_sin_rows(positions)
        cpu_ops.rotary_embedding(index.long(), query, key, table, self.head_size)
        return query, key

    def forward_torch(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference path (any device); leaves its inputs unchanged."""
        cos, sin = self._cos_sin(positions)
        return self._rotate_flat(query, cos, sin), self._rotate_flat(key, cos, sin)

    def rotate_query(self, positions: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """The query alone, rotated to ``positions`` (a new tensor; the input is unchanged)."""
        return self._rotate_flat(query, *self._cos_sin(positions))

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, rotary_dim // 2] cos and sin: broadcast over the heads."""
        table, index = self.cos_sin_rows(positions)
        cos, sin = table.index_select(0, index).chunk(2, dim=-1)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def _rotate_flat(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        heads = x.view(num_tokens, -1, self.head_size)
        if self.is_partial:
            rotated = _rotate(heads[..., : self.rotary_dim], cos, sin)
            return torch.cat((rotated, heads[..., self.rotary_dim :]), dim=-1).view(num_tokens, -1)
        return _rotate(heads, cos, sin).view(num_tokens, -1)

    def forward_triton(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel for query and key, in place (a partial rotation too: the rest of each head
        is neither read nor written, where the torch path copies whole heads to join the parts)."""
        from pagedllm.kernels.triton.rotary import rotary_embedding

        table, index = self.cos_sin_rows(positions)
        rotary_embedding(index, query, key, table, self.head_size, self.rotary_dim)
        return query, key


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_size]; cos, sin: [num_tokens, 1, head_size // 2].

    Writes both halves into one output instead of concatenating: three allocations, not seven,
    with the reference's rounding (each product rounded, then the sum).
    """
    x1, x2 = x.chunk(2, dim=-1)
    if torch.compiler.is_compiling():  # out= into views cannot be traced; inductor fuses this form
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    out = torch.empty_like(x)
    out1, out2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=out1).sub_(x2 * sin)
    torch.mul(x2, cos, out=out2).add_(x1 * sin)
    return out
