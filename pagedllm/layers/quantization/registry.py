"""Which quantization method a checkpoint uses, read from ``quantization_config`` in its
config.json as vLLM reads it (``quant_method``), or asked for with ``quantization=``.

A ``QuantizationConfig`` is parsed and validated once, before any weight is read (every bad value
is a ValueError naming its ``quantization_config`` field); the model loader then asks it, layer by
layer, for the ``LinearMethod`` that keeps that layer's weight (None: the layer is dense, e.g. in
the checkpoint's ignore list), and for FusedMoE layers the experts' method.

    quant_method          formats                                              module
    fp8                   block-scaled (weight_block_size) or per-tensor FP8   fp8.py
    compressed-tensors    float-quantized FP8 W8A8/W8A16, pack-quantized W4A16  compressed_tensors.py
    awq                   AutoAWQ GEMM, 4-bit                                  wna16.py
    gptq                  GPTQ 4/8-bit, desc_act with g_idx                    wna16.py

``quantization="fp8"`` on a checkpoint without ``quantization_config`` quantizes its weights at
load, per output channel, with dynamic per-token activations (vLLM's online FP8).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from torch import nn

from pagedllm.layers.quantization.base import LinearMethod, QuantizationConfig, matches, require, same_for_all
from pagedllm.layers.quantization.compressed_tensors import CompressedTensorsConfig
from pagedllm.layers.quantization.fp8 import (
    ActivationScheme,
    Fp8LinearMethod,
    Fp8Scheme,
    WeightScheme,
)
from pagedllm.layers.quantization.wna16 import AWQMethod, GPTQMethod, IntWeightScheme
from pagedllm.layers.quantization.wna16_moe import IntWeightMoEMethod


class Fp8Config(QuantizationConfig):
    """Hugging Face's ``"fp8"`` (block-scaled or per-tensor), or online FP8 of a dense checkpoint."""

    name = "fp8"

    def __init__(self, scheme: Fp8Scheme, ignored: list[str]) -> None:
        self.scheme = scheme
        self.ignored = ignored

    @classmethod
    def online(cls) -> Fp8Config:
        return cls(Fp8Scheme(WeightScheme.CHANNEL, ActivationScheme.DYNAMIC_TOKEN, online=True), [])

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        activation = config.get("activation_scheme", "dynamic")
        require(activation in ("dynamic", "static"), "activation_scheme", "'dynamic' or 'static'", activation)
        fmt = config.get("fmt", "e4m3")
        require(fmt == "e4m3", "fmt", "'e4m3' (float8_e4m3fn)", fmt)
        block = config.get("weight_block_size")
        ignored = list(config.get("modules_to_not_convert") or config.get("ignored_layers") or [])
        if block is None:
            scheme = Fp8Scheme(
                WeightScheme.TENSOR,
                ActivationScheme.STATIC_TENSOR if activation == "static" else ActivationScheme.DYNAMIC_TOKEN,
            )
            return cls(scheme, ignored)
        require(
            isinstance(block, (list, tuple))
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block),
            "weight_block_size",
            "two positive ints [block_n, block_k]",
            block,
        )
        require(activation == "dynamic", "activation_scheme", "'dynamic' with weight_block_size", activation)
        scheme = Fp8Scheme(
            WeightScheme.BLOCK, ActivationScheme.DYNAMIC_GROUP, tuple(block), "weight_scale_inv"
        )
        return cls(scheme, ignored)

    def get_linear_method(self, layer: nn.Module, prefixes: list[str]) -> LinearMethod | None:
        if same_for_all(prefixes, self.ignored, "modules_to_not_convert"):
            return None
        return Fp8LinearMethod(self.scheme)

    def get_moe_method(self, layer: nn.Module, prefix: str, checkpoint_names: Collection[str] = ()) -> Any:
        from pagedllm.layers.quantization.fp8_moe import Fp8MoEMethod

        if matches(prefix, self.ignored):
            return None
        return Fp8MoEMethod(self.scheme)


def _int_field(config: dict[str, Any], field: str, allowed: tuple[int, ...] | None = None) -> int:
    value = config.get(field)
    ok = isinstance(value, int) and not isinstance(value, bool) and (allowed is None or value in allowed)
    require(ok, field, f"one of {list(allowed)}" if allowed else "an int", value)
    return value


def _group_size(config: dict[str, Any], allow_channel: bool) -> int:
    value = config.get("group_size")
    ok = isinstance(value, int) and ((value > 0 and value % 8 == 0) or (allow_channel and value == -1))
    expected = "a positive multiple of 8" + (" or -1 (one group per row)" if allow_channel else "")
    require(ok, "group_size", expected, value)
    return value


class AWQConfig(QuantizationConfig):
    """AutoAWQ's GEMM format: 4-bit weights with zero points, groups of ``group_size`` inputs."""

    name = "awq"

    def __init__(self, group_size: int, ignored: list[str]) -> None:
        self.scheme = IntWeightScheme(4, group_size, symmetric=False)
        self.ignored = ignored

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        bits = config.get("bits", config.get("w_bit"))
        require(bits == 4, "bits", "4 (AWQ's GEMM packing)", bits)
        group_size = _group_size({"group_size": config.get("group_size", config.get("q_group_size"))}, False)
        zero_point = config.get("zero_point", True)
        require(zero_point is True, "zero_point", "true", zero_point)
        version = str(config.get("version", "gemm")).lower()
        require(version == "gemm", "version", "'gemm' (GEMV packing is not supported)", version)
        return cls(group_size, list(config.get("modules_to_not_convert") or []))

    def get_linear_method(self, layer: nn.Module, prefixes: list[str]) -> LinearMethod | None:
        if same_for_all(prefixes, self.ignored, "modules_to_not_convert"):
            return None
        return AWQMethod(self.scheme)

    def get_moe_method(self, layer: nn.Module, prefix: str, checkpoint_names: Collection[str] = ()) -> Any:
        # AutoAWQ quantizes every expert's projections.
        return None if matches(prefix, self.ignored) else IntWeightMoEMethod(lambda: AWQMethod(self.scheme))


class GPTQConfig(QuantizationConfig):
    """GPTQ (AutoGPTQ, GPTQModel): 4- or 8-bit, optional act order (``desc_act``)."""

    name = "gptq"

    def __init__(self, scheme: IntWeightScheme, desc_act: bool, zero_offset: int, ignored: list[str]) -> None:
        self.scheme = scheme
        self.desc_act = desc_act
        self.zero_offset = zero_offset
        self.ignored = ignored

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        bits = _int_field(config, "bits", (4, 8))
        group_size = _group_size(config, True)
        desc_act = config.get("desc_act", False)
        require(isinstance(desc_act, bool), "desc_act", "a bool", desc_act)
        sym = config.get("sym", True)
        require(isinstance(sym, bool), "sym", "a bool", sym)
        fmt = config.get("checkpoint_format", "gptq")
        require(fmt in ("gptq", "gptq_v2"), "checkpoint_format", "'gptq' or 'gptq_v2'", fmt)
        ignored = list(config.get("modules_to_not_convert") or [])
        return cls(IntWeightScheme(bits, group_size, sym), desc_act, 1 if fmt == "gptq" else 0, ignored)

    def get_linear_method(self, layer: nn.Module, prefixes: list[str]) -> LinearMethod | None:
        if same_for_all(prefixes, self.ignored, "modules_to_not_convert"):
            return None
        return GPTQMethod(self.scheme, self.desc_act, self.zero_offset)

    def get_moe_method(self, layer: nn.Module, prefix: str, checkpoint_names: Collection[str] = ()) -> Any:
        # GPTQModel quantizes every expert's projections.
        if matches(prefix, self.ignored):
            return None
        return IntWeightMoEMethod(lambda: GPTQMethod(self.scheme, self.desc_act, self.zero_offset))


# quant_method -> its config class.
QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    "fp8": Fp8Config,
    "awq": AWQConfig,
    "gptq": GPTQConfig,
    "compressed-tensors": CompressedTensorsConfig,
}


def get_quantization_config(hf_config: Any, quantization: str) -> QuantizationConfig | None:
    """The checkpoint's quantization, reconciled with the ``quantization`` argument ("auto",
    "none", "gguf", or a quant_method to insist on; "fp8" also quantizes a dense checkpoint)."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict):
        raw = raw.to_dict()
    if raw is None:
        if quantization == "fp8":
            return Fp8Config.online()
        if quantization in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization={quantization!r} needs a checkpoint quantized with it (a quantization_config "
                "in config.json); only 'fp8' quantizes a dense checkpoint at load"
            )
        return None
    method = raw.get("quant_method")
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported; "
            f"supported: {sorted(QUANTIZATION_METHODS)}"
        )
    if quantization not in ("auto", method):
        raise ValueError(
            f"quantization={quantization!r} does not match the checkpoint's quantization_config.quant_method "
            f"{method!r} (pass quantization='auto' or {method!r})"
        )
    return QUANTIZATION_METHODS[method].from_config(raw)
