"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``), as llm-compressor writes
them: ``config_groups`` of a scheme and the module ``targets`` it applies to, an ``ignore`` list,
and a ``format`` per group or for the whole checkpoint.

Supported schemes (anything else is refused, naming its field):

    weights                                   input_activations                   format
    float 8-bit, tensor / channel / block     none (W8A16), dynamic token,        float-quantized
                                              dynamic group (block), static tensor
    int 4- or 8-bit, group / channel,         none (W4A16, W8A16)                 pack-quantized
    symmetric or not
    int 8-bit, channel / tensor, symmetric    int 8-bit dynamic token or static   int-quantized
                                              tensor, symmetric (W8A8-INT8)

FP8 schemes run through ``Fp8LinearMethod`` (fp8.py), weight-only integer ones through
``PackQuantizedMethod`` (wna16.py), W8A8-INT8 through ``Int8W8A8Method`` (int8.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from torch import nn

from pagedllm.layers.quantization.base import LinearMethod, QuantizationConfig, matches, require, same_for_all
from pagedllm.layers.quantization.fp8 import ActivationScheme, Fp8LinearMethod, Fp8Scheme, WeightScheme
from pagedllm.layers.quantization.fp8_moe import Fp8MoEMethod
from pagedllm.layers.quantization.int8 import Int8Activation, Int8Scheme, Int8W8A8Method
from pagedllm.layers.quantization.wna16 import IntWeightScheme, PackQuantizedMethod
from pagedllm.layers.quantization.wna16_moe import IntWeightMoEMethod

MethodFactory = Callable[[], LinearMethod]
_FP8_WEIGHT_STRATEGIES = {
    "tensor": WeightScheme.TENSOR,
    "channel": WeightScheme.CHANNEL,
    "block": WeightScheme.BLOCK,
}


def _fp8_activation(
    field: str, inputs: dict[str, Any] | None, block: tuple[int, int] | None
) -> ActivationScheme:
    if inputs is None:
        return ActivationScheme.NONE
    kind = (inputs.get("type"), inputs.get("num_bits"))
    require(kind == ("float", 8), f"{field}.type/num_bits", "float/8 (FP8 activations)", kind)
    strategy, dynamic = inputs.get("strategy"), inputs.get("dynamic")
    if dynamic is True and strategy == "token":
        return ActivationScheme.DYNAMIC_TOKEN
    if dynamic is True and strategy == "group" and block is not None and inputs.get("group_size") == block[1]:
        return ActivationScheme.DYNAMIC_GROUP
    if dynamic is False and strategy == "tensor":
        return ActivationScheme.STATIC_TENSOR
    expected = "dynamic token, dynamic group (block weights, group_size = block_k) or static tensor"
    require(False, f"{field}.strategy/dynamic", expected, (strategy, dynamic))
    raise AssertionError  # unreachable: require raised


def _fp8_scheme(
    field: str, weights: dict[str, Any], inputs: dict[str, Any] | None, fmt: str
) -> MethodFactory:
    require(fmt == "float-quantized", f"{field}.format", "'float-quantized' for FP8 weights", fmt)
    strategy = weights.get("strategy")
    require(
        strategy in _FP8_WEIGHT_STRATEGIES,
        f"{field}.weights.strategy",
        str(sorted(_FP8_WEIGHT_STRATEGIES)),
        strategy,
    )
    require(
        weights.get("symmetric", True) is True,
        f"{field}.weights.symmetric",
        "true for FP8",
        weights.get("symmetric"),
    )
    block = None
    if strategy == "block":
        block = weights.get("block_structure")
        ok = isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
        require(ok, f"{field}.weights.block_structure", "two positive ints", block)
        block = tuple(block)
    activation = _fp8_activation(f"{field}.input_activations", inputs, block)
    scheme = Fp8Scheme(_FP8_WEIGHT_STRATEGIES[strategy], activation, block, "weight_scale")
    return lambda: Fp8LinearMethod(scheme)


def _int_scheme(
    field: str, weights: dict[str, Any], inputs: dict[str, Any] | None, fmt: str
) -> MethodFactory:
    require(fmt == "pack-quantized", f"{field}.format", "'pack-quantized' for integer weights", fmt)
    require(inputs is None, f"{field}.input_activations", "null (weight-only integer schemes)", inputs)
    bits = weights.get("num_bits")
    require(bits in (4, 8), f"{field}.weights.num_bits", "4 or 8", bits)
    strategy = weights.get("strategy")
    require(strategy in ("group", "channel"), f"{field}.weights.strategy", "'group' or 'channel'", strategy)
    # GPTQ's activation ordering (compressed-tensors' ActivationOrdering): "weight" (alias
    # "static", llm-compressor's default) quantizes the columns in activation order but keeps each
    # in its own contiguous group, so nothing differs at inference; "group" (alias "dynamic")
    # groups the columns in that order and stores each input's group (weight_g_idx), as GPTQ's
    # desc_act does.
    actorder = weights.get("actorder")
    require(
        actorder in (None, False, "weight", "static", "group", "dynamic"),
        f"{field}.weights.actorder",
        "null, 'weight' ('static') or 'group' ('dynamic')",
        actorder,
    )
    g_idx = actorder in ("group", "dynamic")
    require(
        not g_idx or strategy == "group",
        f"{field}.weights.strategy",
        f"'group' with actorder {actorder!r}",
        strategy,
    )
    group_size = -1
    if strategy == "group":
        group_size = weights.get("group_size")
        require(
            isinstance(group_size, int) and group_size > 0,
            f"{field}.weights.group_size",
            "a positive int",
            group_size,
        )
    symmetric = weights.get("symmetric", True)
    require(isinstance(symmetric, bool), f"{field}.weights.symmetric", "a bool", symmetric)
    scheme = IntWeightScheme(bits, group_size, symmetric)
    return lambda: PackQuantizedMethod(scheme, per_channel=strategy == "channel", g_idx=g_idx)


def _int8_scheme(field: str, weights: dict[str, Any], inputs: dict[str, Any], fmt: str) -> MethodFactory:
    """W8A8-INT8: symmetric int8 weights per channel or tensor, int8 activations per token
    (dynamic) or per tensor (static), symmetric."""
    require(fmt == "int-quantized", f"{field}.format", "'int-quantized' for int8 activations", fmt)
    require(
        weights.get("num_bits") == 8,
        f"{field}.weights.num_bits",
        "8 with int8 activations",
        weights.get("num_bits"),
    )
    strategy = weights.get("strategy")
    require(strategy in ("channel", "tensor"), f"{field}.weights.strategy", "'channel' or 'tensor'", strategy)
    require(
        weights.get("symmetric", True) is True, f"{field}.weights.symmetric", "true", weights.get("symmetric")
    )
    kind = (inputs.get("type"), inputs.get("num_bits"))
    require(kind == ("int", 8), f"{field}.input_activations.type/num_bits", "int/8", kind)
    require(
        inputs.get("symmetric", True) is True,
        f"{field}.input_activations.symmetric",
        "true",
        inputs.get("symmetric"),
    )
    mode = (inputs.get("strategy"), inputs.get("dynamic"))
    activations = {
        ("token", True): Int8Activation.DYNAMIC_TOKEN,
        ("tensor", False): Int8Activation.STATIC_TENSOR,
    }
    require(
        mode in activations,
        f"{field}.input_activations.strategy/dynamic",
        "dynamic token or static tensor",
        mode,
    )
    scheme = Int8Scheme(per_channel=strategy == "channel", activation=activations[mode])
    return lambda: Int8W8A8Method(scheme)


def _parse_group(field: str, group: dict[str, Any], default_format: str | None) -> MethodFactory:
    weights = group.get("weights")
    require(
        isinstance(weights, dict),
        f"{field}.weights",
        "a dict (activation-only schemes are not supported)",
        weights,
    )
    fmt = group.get("format") or default_format
    kind = weights.get("type")
    if kind == "float" and weights.get("num_bits") == 8:
        return _fp8_scheme(field, weights, group.get("input_activations"), fmt)
    inputs = group.get("input_activations")
    if kind == "int" and inputs is not None:
        return _int8_scheme(field, weights, inputs, fmt)
    if kind == "int":
        return _int_scheme(field, weights, inputs, fmt)
    require(
        False, f"{field}.weights.type/num_bits", "float/8 or int/4 or int/8", (kind, weights.get("num_bits"))
    )
    raise AssertionError  # unreachable: require raised


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, groups: list[tuple[str, list[str], MethodFactory]], ignored: list[str]) -> None:
        self.groups = groups  # (field, targets, method factory), in the config's order
        self.ignored = ignored
        # The checkpoint names last asked about, and the expert modules among them that hold
        # scales (``<experts>.<e>.<projection>.weight_scale``): read once for every MoE layer.
        self._scaled_experts: tuple[Collection[str], frozenset[str]] | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        status = config.get("quantization_status", "compressed")
        require(status == "compressed", "quantization_status", "'compressed'", status)
        require(config.get("kv_cache_scheme") is None, "kv_cache_scheme", "null (no FP8 KV cache yet)", "set")
        groups = config.get("config_groups")
        require(isinstance(groups, dict) and groups, "config_groups", "a non-empty dict", groups)
        parsed = []
        for name, group in groups.items():
            field = f"config_groups.{name}"
            targets = group.get("targets")
            require(isinstance(targets, list) and targets, f"{field}.targets", "a non-empty list", targets)
            parsed.append((field, targets, _parse_group(field, group, config.get("format"))))
        return cls(parsed, list(config.get("ignore") or []))

    def get_linear_method(self, layer: nn.Module, prefixes: list[str]) -> LinearMethod | None:
        if same_for_all(prefixes, self.ignored, "ignore"):
            return None
        chosen = {self._group_of(prefix) for prefix in prefixes}
        if len(chosen) > 1:
            raise ValueError(
                f"quantization_config.config_groups give the merged projections {prefixes} different schemes"
            )
        index = chosen.pop()
        return None if index is None else self.groups[index][2]()

    def _group_of(self, prefix: str) -> int | None:
        """The index of the first group whose targets take the linear module ``prefix``."""
        for index, (_, targets, _) in enumerate(self.groups):
            if "Linear" in targets or matches(prefix, targets):
                return index
        return None

    def get_moe_method(self, layer: nn.Module, prefix: str, checkpoint_names: Collection[str] = ()) -> Any:
        """Experts as the checkpoint stores them. llm-compressor quantizes each expert's
        projections as the Linear modules they were (one set of tensors per expert; transformers 4,
        or its calibration's unfused experts); compressed-tensors on transformers 5's fused
        experts, which are no Linear modules, leaves them dense. So the experts are quantized
        where the checkpoint has their scales, with the scheme of the group that takes their
        projections: integer (pack-quantized) or FP8 (float-quantized)."""
        if matches(prefix, self.ignored):
            return None
        if self._scaled_experts is None or self._scaled_experts[0] is not checkpoint_names:
            scaled = frozenset(n.rsplit(".", 3)[0] for n in checkpoint_names if n.endswith(".weight_scale"))
            self._scaled_experts = (checkpoint_names, scaled)
        if prefix not in self._scaled_experts[1]:
            return None
        index = self._group_of(f"{prefix}.0.down_proj")
        if index is None:
            raise ValueError(
                f"quantization_config.config_groups: no group's targets take the experts {prefix}"
            )
        method = self.groups[index][2]()
        if isinstance(method, Fp8LinearMethod):
            return Fp8MoEMethod(method.scheme)
        if not isinstance(method, PackQuantizedMethod):
            raise ValueError(
                f"quantization_config.{self.groups[index][0]}: quantized experts ({prefix}) are supported "
                "as FP8 (float-quantized) or weight-only integers (pack-quantized), not W8A8-INT8"
            )
        return IntWeightMoEMethod(self.groups[index][2])
