"""Integer weight-only linear layers (W4A16, W8A16) in the packings people publish: AutoAWQ's GEMM
format, GPTQ's (AutoGPTQ / GPTQModel, with ``desc_act``'s ``g_idx``) and compressed-tensors'
pack-quantized (llm-compressor's W4A16, symmetric or asymmetric).

All three store ``w = (q - z) * s`` per group of ``group_size`` consecutive inputs of one output
row (``-1``: one group over every input), differing in where the bits sit:

    format     tensor               shape                 packed along   nibble order in an int32
    AWQ        qweight              [K, N / 8]            output         columns 0 2 4 6 1 3 5 7
               qzeros               [K / g, N / 8]        output         (the same)
               scales               [K / g, N]
    GPTQ       qweight              [K / (32/b), N]       input          sequential (value i at 4 i)
               qzeros               [K / g, N / (32/b)]   output         sequential; stores z - 1
               scales               [K / g, N]                           (checkpoint_format "gptq")
               g_idx                [K]                                  group of each input row
    c-t pack   weight_packed        [N, K / (32/b)]       input          sequential, q + 2^(b-1)
               weight_zero_point    [N / (32/b), K / g]   output         (asymmetric only)
               weight_scale         [N, K / g]
               weight_shape         [2]
               weight_g_idx         [K]                                  group of each input row
                                                                         (actorder "group")

AWQ and GPTQ are transposed (``[K, N]``: output features along dimension 1). With ``desc_act``
(compressed-tensors: ``actorder`` "group") the inputs are grouped in a permuted order, so a
row-parallel shard's inputs may belong to any group: its scales and zeros are then kept whole on
every rank and ``g_idx`` (sharded) picks from them.

After loading, every format unpacks to one form, ``UnpackedWeight``: the integers ``q [N, K]``
and per-group zero points and scales ``[N, K / g]``. From it a layer either runs the dequantized
product (the weight dequantized once, exactly in float32, then held in the model dtype: the
CPU's path and the oracle) or, on CUDA for 4-bit weights in groups of a multiple of 8, repacks it
for the Triton W4A16 kernels: batches of at most 16 tokens take the weight-read-bound
kernels/triton/skinny_gemm.py, larger ones the weight dequantized by one launch for cuBLAS
(kernels/triton/quant_gemm.py). Groups in activation order (``g_idx``) are not contiguous in
K: those layers run dequantized everywhere, with a notice.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.quantization.base import LinearMethod, notify_fallback
from pagedllm.layers.quantization.params import PER_PROJECTION, ParamLayout, check_layer_divides, set_layout
from pagedllm.layers.utils import CheckpointSlice, CheckpointTensor

# AutoAWQ's GEMM packing puts column order[j] of each 8 in nibble j; this reverses it.
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Sequential unsigned ``bits``-bit fields of int32 words, along ``dim`` -> int32, ``32 / bits``
    times longer along it (value ``i`` of a word at bits ``[i * bits, (i + 1) * bits)``)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    moved = packed.movedim(dim, -1)
    fields = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per_word]
    return fields.reshape(*moved.shape[:-1], moved.shape[-1] * per_word).movedim(-1, dim)


@dataclass
class UnpackedWeight:
    """q: int32 [N, K]; zeros (same offset as q) and scales: [N, K / group_size], float32;
    ``q + offset`` is unsigned (compressed-tensors' q is signed)."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_size: int
    offset: int = 0

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: ``(q - z) * s``, exact (small integers times the checkpoint's scales)."""
        k = self.q.shape[1]
        zeros = self.zeros.repeat_interleave(self.group_size, 1)[:, :k]
        return (self.q.float() - zeros) * self.scales.repeat_interleave(self.group_size, 1)[:, :k]


@dataclass(frozen=True)
class IntWeightScheme:
    bits: int
    group_size: int  # -1: one group per output row
    symmetric: bool = True


class IntWeightMethod(LinearMethod):
    """Shared by the three packings: make the checkpoint's tensors, dequantize after loading."""

    # The checkpoint's tensor names, deleted once unpacked.
    tensor_names: ClassVar[tuple[str, ...]]

    def __init__(self, scheme: IntWeightScheme) -> None:
        self.scheme = scheme
        self.pack_factor = 32 // scheme.bits
        # The kernels' products (x, qweight, scales, zeros) -> out, chosen after loading; None:
        # the dequantized weight's F.linear. Batches of at most skinny_max_m tokens take skinny_gemm.
        self.gemm: Callable[..., torch.Tensor] | None = None
        self.skinny_gemm: Callable[..., torch.Tensor] | None = None
        self.skinny_max_m = 0

    def group_size(self, layer: nn.Module) -> int:
        return self.scheme.group_size if self.scheme.group_size != -1 else layer.input_size_total

    def create_weights(self, layer: nn.Module) -> None:
        n, k = layer.weight.shape
        layer.params_dtype = layer.weight.dtype
        group = self.group_size(layer)
        if layer.input_size_total % group:
            raise ValueError(
                f"group_size={group} does not divide the {layer.input_size_total} input features"
            )
        self.check_divides(layer, group)
        self.input_size = k  # this rank's
        loader = layer.weight.weight_loader
        del layer.weight
        for name, (tensor, layout) in self.tensors(layer, n, k, group).items():
            param = set_layout(nn.Parameter(tensor, requires_grad=False), layout)
            param.weight_loader = functools.partial(load_g_idx, layer) if name.endswith("g_idx") else loader
            setattr(layer, name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        unpacked = self.unpack(layer)
        for name in self.tensor_names:
            delattr(layer, name)
        if not self.kernel_fits(unpacked, layer.params_dtype, unpacked.q.device):
            layer.register_buffer("weight", unpacked.dequantize().to(layer.params_dtype), persistent=False)
            return
        from pagedllm.kernels.triton.quant_gemm import pack_w4a16, w4a16_gemm
        from pagedllm.kernels.triton.skinny_gemm import SKINNY_MAX_M, group_in_tile, reserve, skinny_gemm

        # The kernel's nibbles are unsigned: q and z shift together, so q - z is unchanged.
        shift = unpacked.offset
        layer.register_buffer("qweight_k", pack_w4a16(unpacked.q + shift), persistent=False)
        # Row-major [N, groups] (AWQ's and GPTQ's come transposed).
        scales, zeros = unpacked.scales.contiguous(), (unpacked.zeros + shift).contiguous()
        layer.register_buffer("scales_k", scales.to(layer.params_dtype), persistent=False)
        layer.register_buffer("zeros_k", zeros.to(layer.params_dtype), persistent=False)
        self.gemm = functools.partial(w4a16_gemm, group_size=unpacked.group_size)
        # Decode-sized batches: the GEMV-shaped kernel that reads each packed word once.
        if group_in_tile(unpacked.group_size, unpacked.q.shape[1], 16) is not None:
            self.skinny_gemm = functools.partial(skinny_gemm, group_k=unpacked.group_size)
            self.skinny_max_m = SKINNY_MAX_M
            reserve(unpacked.q.device)

    def kernel_fits(self, unpacked: UnpackedWeight, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the Triton W4A16 GEMM takes this weight (CUDA, 4 bits, groups it can tile)."""
        from pagedllm.platform import platform_for

        if device.type == "cpu":
            return False  # by design: the dequantized product is the CPU's path and the oracle
        if platform_for(device).triton and self.scheme.bits == 4 and dtype != torch.float32:
            from pagedllm.kernels.triton.quant_gemm import w4a16_fits

            if w4a16_fits(unpacked.group_size, unpacked.q.shape[1]):
                return True
        notify_fallback(f"{type(self).__name__} weights ({self.scheme.bits}-bit, these groups)", device)
        return False

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.gemm is None:
            return F.linear(x, layer.weight, bias)
        if x.shape[0] <= self.skinny_max_m:
            out = self.skinny_gemm(x, layer.qweight_k, layer.scales_k, zeros=layer.zeros_k)
        else:
            out = self.gemm(x, layer.qweight_k, layer.scales_k, layer.zeros_k)
        return out if bias is None else out.add_(bias)

    @abstractmethod
    def check_divides(self, layer: nn.Module, group: int) -> None:
        """Refuse shards that cut a group or a packed word."""

    @abstractmethod
    def tensors(
        self, layer: nn.Module, n: int, k: int, group: int
    ) -> dict[str, tuple[torch.Tensor, ParamLayout]]:
        """The checkpoint's tensors of this rank's [n, k] weight, empty, with their layouts."""

    @abstractmethod
    def unpack(self, layer: nn.Module) -> UnpackedWeight:
        """The loaded tensors as integers, zeros and scales."""


class AWQMethod(IntWeightMethod):
    """AutoAWQ's GEMM packing (4-bit, zero points)."""

    tensor_names = ("qweight", "qzeros", "scales")

    def check_divides(self, layer: nn.Module, group: int) -> None:
        check_layer_divides(layer, 8, group, "8 values per int32 word (AWQ bits=4)", f"group_size={group}")

    def tensors(
        self, layer: nn.Module, n: int, k: int, group: int
    ) -> dict[str, tuple[torch.Tensor, ParamLayout]]:
        pf = self.pack_factor
        return {
            "qweight": (torch.empty(k, n // pf, dtype=torch.int32), ParamLayout(1, 0, pf, 1)),
            "qzeros": (torch.empty(k // group, n // pf, dtype=torch.int32), ParamLayout(1, 0, pf, group)),
            "scales": (torch.empty(k // group, n, dtype=torch.float32), ParamLayout(1, 0, 1, group)),
        }

    def unpack(self, layer: nn.Module) -> UnpackedWeight:
        q = self._unpack_columns(layer.qweight.data).t()  # [n, k]
        zeros = self._unpack_columns(layer.qzeros.data).t().float()
        return UnpackedWeight(q, zeros, layer.scales.data.float().t(), self.group_size(layer))

    def _unpack_columns(self, packed: torch.Tensor) -> torch.Tensor:
        fields = unpack_int32(packed, self.scheme.bits, 1)
        order = torch.tensor(AWQ_REVERSE_ORDER, device=packed.device)
        return fields.view(fields.shape[0], -1, 8)[..., order].reshape(fields.shape)


class GPTQMethod(IntWeightMethod):
    """GPTQ's packing; ``desc_act`` takes each input row's group from ``g_idx``; ``zero_offset``
    is 1 for the original format, whose zeros are stored minus one (0 for ``gptq_v2``)."""

    tensor_names = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, scheme: IntWeightScheme, desc_act: bool, zero_offset: int) -> None:
        super().__init__(scheme)
        self.desc_act = desc_act
        self.zero_offset = zero_offset

    def check_divides(self, layer: nn.Module, group: int) -> None:
        pf = self.pack_factor
        what = f"{pf} values per int32 word (GPTQ bits={self.scheme.bits})"
        check_layer_divides(layer, pf, pf, what, what)
        if not self.whole_groups:
            check_layer_divides(layer, 1, group, "", f"group_size={group}")

    @property
    def whole_groups(self) -> bool:
        """Scales and zeros kept whole on every rank: with desc_act, or one group per row."""
        return self.desc_act or self.scheme.group_size == -1

    def tensors(
        self, layer: nn.Module, n: int, k: int, group: int
    ) -> dict[str, tuple[torch.Tensor, ParamLayout]]:
        pf = self.pack_factor
        # With desc_act a rank's inputs may fall in any group: scales and zeros stay whole.
        num_groups = layer.input_size_total // group if self.whole_groups else k // group
        group_dim = None if self.whole_groups else 0
        num_projections = len(layer.output_sizes)
        return {
            "qweight": (torch.empty(k // pf, n, dtype=torch.int32), ParamLayout(1, 0, 1, pf)),
            "qzeros": (
                torch.empty(num_groups, n // pf, dtype=torch.int32),
                ParamLayout(1, group_dim, pf, group),
            ),
            "scales": (torch.empty(num_groups, n, dtype=torch.float32), ParamLayout(1, group_dim, 1, group)),
            # One row per projection: each merged projection was quantized with its own order.
            "g_idx": (torch.empty(num_projections, k, dtype=torch.int32), PER_PROJECTION),
        }

    def unpack(self, layer: nn.Module) -> UnpackedWeight:
        bits = self.scheme.bits
        q = unpack_int32(layer.qweight.data, bits, 0).t()  # [n, k]
        zeros = (unpack_int32(layer.qzeros.data, bits, 1) + self.zero_offset).t().float()  # [n, groups]
        scales = layer.scales.data.float().t()
        if not self.desc_act:  # contiguous groups (one over this rank's inputs for group_size -1)
            group = q.shape[1] if self.scheme.group_size == -1 else self.group_size(layer)
            return UnpackedWeight(q, zeros, scales, group)
        return UnpackedWeight(q, *expand_groups(layer, layer.g_idx.data, zeros, scales), 1)


def expand_groups(
    layer: nn.Module, g_idx: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeros and scales ``[N, num_groups]`` (whole: every group) as one column per input of this
    rank, ``[N, K]``, each input's from its group (``g_idx`` ``[num_projections, K]``, a row per
    projection of a merged layer: each was quantized in its own order). Groups of one input, which
    no kernel takes."""
    rows, start = [], 0
    for projection, size in enumerate(layer.output_partition_sizes):
        index = g_idx[projection].long()
        rows.append((zeros[start : start + size, index], scales[start : start + size, index]))
        start += size
    return torch.cat([z for z, _ in rows]), torch.cat([s for _, s in rows])


def load_g_idx(
    layer: nn.Module, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | str | None
) -> None:
    """A projection's g_idx [K] into its row of ``param``; a row-parallel rank takes its inputs."""
    value = loaded.read() if isinstance(loaded, CheckpointSlice) else loaded
    k = param.shape[1]
    if value.shape[0] != layer.input_size_total:
        raise ValueError(
            f"shape mismatch: g_idx of {value.shape[0]} inputs, the layer has {layer.input_size_total}"
        )
    if k != layer.input_size_total:  # row parallel: this rank's inputs
        value = value.narrow(0, layer.tp_rank * k, k)
    projection = {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id) or 0
    param.data[projection].copy_(value)


class PackQuantizedMethod(IntWeightMethod):
    """compressed-tensors' pack-quantized format (llm-compressor's W4A16 / W8A16); ``g_idx``: the
    "group" activation order, each input's group in ``weight_g_idx`` (as GPTQ's desc_act: scales
    and zeros whole on every rank, the layer dequantized)."""

    def __init__(self, scheme: IntWeightScheme, per_channel: bool, g_idx: bool = False) -> None:
        super().__init__(scheme)
        self.per_channel = per_channel
        self.g_idx = g_idx
        self.offset = 1 << (scheme.bits - 1)  # the packing stores q + 2^(b-1), unsigned

    @property
    def tensor_names(self) -> tuple[str, ...]:
        names = ("weight_packed", "weight_scale", "weight_shape")
        names = names if self.scheme.symmetric else (*names, "weight_zero_point")
        return (*names, "weight_g_idx") if self.g_idx else names

    def check_divides(self, layer: nn.Module, group: int) -> None:
        pf = self.pack_factor
        out_unit = 1 if self.scheme.symmetric else pf
        what = f"{pf} zero points per int32 word (bits={self.scheme.bits})"
        # Groups in activation order span any inputs: no shard of the inputs can cut one.
        whole = self.per_channel or self.g_idx
        check_layer_divides(layer, out_unit, 1 if whole else group, what, f"group_size={group}")
        check_layer_divides(layer, 1, pf, "", f"{pf} values per int32 word (bits={self.scheme.bits})")

    def tensors(
        self, layer: nn.Module, n: int, k: int, group: int
    ) -> dict[str, tuple[torch.Tensor, ParamLayout]]:
        pf = self.pack_factor
        if self.per_channel:
            scale_layout, zero_layout, num_groups = ParamLayout(0, None), ParamLayout(0, None, pf, 1), 1
        elif self.g_idx:  # every group on every rank
            num_groups = layer.input_size_total // group
            scale_layout, zero_layout = ParamLayout(0, None), ParamLayout(0, None, pf, 1)
        else:
            scale_layout, zero_layout, num_groups = (
                ParamLayout(0, 1, 1, group),
                ParamLayout(0, 1, pf, group),
                k // group,
            )
        tensors = {
            "weight_packed": (torch.empty(n, -(-k // pf), dtype=torch.int32), ParamLayout(0, 1, 1, pf)),
            "weight_scale": (torch.empty(n, num_groups, dtype=torch.float32), scale_layout),
            "weight_shape": (torch.empty(len(layer.output_sizes), 2, dtype=torch.int64), PER_PROJECTION),
        }
        if not self.scheme.symmetric:
            tensors["weight_zero_point"] = (
                torch.empty(-(-n // pf), num_groups, dtype=torch.int32),
                zero_layout,
            )
        if self.g_idx:
            tensors["weight_g_idx"] = (
                torch.empty(len(layer.output_sizes), k, dtype=torch.int32),
                PER_PROJECTION,
            )
        return tensors

    def unpack(self, layer: nn.Module) -> UnpackedWeight:
        bits, n, k = self.scheme.bits, layer.weight_packed.shape[0], self.input_size
        group = k if self.per_channel else self.group_size(layer)
        q = (unpack_int32(layer.weight_packed.data, bits, 1) - self.offset)[:, :k]  # rows padded to words
        scales = layer.weight_scale.data.float()
        if self.scheme.symmetric:
            zeros = torch.zeros_like(scales)
        else:
            zeros = (unpack_int32(layer.weight_zero_point.data, bits, 0)[:n] - self.offset).float()
        if self.g_idx:
            return UnpackedWeight(
                q, *expand_groups(layer, layer.weight_g_idx.data, zeros, scales), 1, self.offset
            )
        return UnpackedWeight(q, zeros, scales, group, self.offset)
