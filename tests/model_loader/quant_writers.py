"""Quantized checkpoints of a tiny HF model, written as the real tools write them, and the dense HF
model each one stands for (its reference). Imported by the quantized-checkpoint tests only.

* compressed-tensors: the library itself quantizes, compresses and saves (``ModelCompressor``);
  the reference is transformers' own load of that directory, decompressed by compressed-tensors,
  with compressed-tensors' own fake quantization of the activations where the scheme has them.
* fp8 (Hugging Face / DeepSeek-V3 block-scaled, or per-tensor), AWQ (GEMM) and GPTQ (desc_act):
  an independent packer written here from the published layouts (not pagedllm's code): the
  integers and scales are computed first, the reference takes them straight, and only the
  checkpoint goes through the packing.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, CompressedTensorsConfig, PreTrainedModel

FP8 = torch.float8_e4m3fn
LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")
EXPERTS = re.compile(r"^(?P<prefix>model\.layers\.\d+\.mlp\.experts)\.(?P<param>gate_up_proj|down_proj)$")


# --- activation rounding of the references -------------------------------------------------


def qdq_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(FP8).to(x.dtype) * scale


def token_group_qdq(group: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """DeepSeek-V3's act_quant: each token's groups of ``group`` inputs under amax / 448."""

    def qdq(x: torch.Tensor) -> torch.Tensor:
        groups = x.unflatten(-1, (-1, group))
        scale = groups.abs().amax(-1, keepdim=True) / 448
        scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
        return qdq_fp8(groups, scale).flatten(-2)

    return qdq


def per_token_qdq(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True) / 448
    return qdq_fp8(x, torch.where(scale == 0, torch.finfo(torch.float32).eps, scale))


def round_linear_inputs(
    model: nn.Module, qdq: Callable[[torch.Tensor], torch.Tensor], skip: str = "lm_head"
) -> None:
    """Every quantized Linear of ``model`` rounds its input through ``qdq`` (a pre-hook)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and skip not in name and not name.endswith("mlp.gate"):
            module.register_forward_pre_hook(lambda _, args: (qdq(args[0]),))


def round_expert_inputs(model: nn.Module, qdq: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """transformers' Qwen3-MoE experts with both matmul inputs rounded (their loop, plus qdq)."""
    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
            module.forward = _rounded_experts_forward(module, qdq)


def _rounded_experts_forward(experts: nn.Module, qdq: Callable) -> Callable:
    def forward(
        hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for token in range(hidden_states.shape[0]):
            for slot in range(top_k_index.shape[1]):
                e = int(top_k_index[token, slot])
                x = qdq(hidden_states[token : token + 1])
                gate, up = nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
                h = qdq(experts.act_fn(gate) * up)
                out[token] += (nn.functional.linear(h, experts.down_proj[e]) * top_k_weights[token, slot])[0]
        return out

    return forward


# --- compressed-tensors --------------------------------------------------------------------


def write_compressed_tensors(
    hf_model: PreTrainedModel,
    out_dir: Path,
    scheme: dict,
    fmt: str,
    calibration: torch.Tensor,
    with_reference: bool = True,
) -> PreTrainedModel | None:
    """Quantize ``hf_model``'s linear layers with compressed-tensors (scheme: QuantizationScheme
    fields), save the compressed checkpoint to ``out_dir``; returns the reference model (None
    without ``with_reference``: transformers 5 cannot load back a mixture of experts it saved so)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = copy.deepcopy(hf_model)
    amax = _observe_input_amax(model, calibration)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
        ignore=["lm_head"],
        format=fmt,
    )
    apply_quantization_config(model, config)
    for name, module in model.named_modules():
        qscheme = getattr(module, "quantization_scheme", None)
        if qscheme is None:
            continue
        scale, zero_point = calculate_qparams(
            *_weight_min_max(module.weight, qscheme.weights), qscheme.weights
        )
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
        if hasattr(
            module, "input_scale"
        ):  # static: the calibration's amax over the type's half range, as its minmax observer
            half_range = 448 if qscheme.input_activations.type == "float" else 127.5
            module.input_scale.data.fill_(amax[name] / half_range)
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))
    if not with_reference:
        return None
    reference = AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
    ).eval()
    if scheme.get("input_activations") is not None:
        _round_inputs_as_compressed_tensors(reference, scheme["input_activations"], out_dir)
    return reference


def _weight_min_max(w: torch.Tensor, args: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The min and max a min-max observer sees, per the scheme's strategy."""
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy == "group":
        groups = w.unflatten(-1, (-1, args.group_size))
        return groups.amin(-1), groups.amax(-1)
    if args.strategy == "block":
        bn, bk = args.block_structure
        tiles = w.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))
        return tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
    return w.min(), w.max()


def _observe_input_amax(model: nn.Module, calibration: torch.Tensor) -> dict[str, torch.Tensor]:
    amax: dict[str, torch.Tensor] = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda _, args, name=name: amax.__setitem__(
                name, torch.maximum(amax.get(name, torch.tensor(0.0)), args[0].abs().max())
            )
        )
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    ]
    with torch.no_grad():
        model(calibration)
    for hook in hooks:
        hook.remove()
    return amax


def _round_inputs_as_compressed_tensors(model: nn.Module, args: dict, out_dir: Path) -> None:
    """compressed-tensors' own activation fake quantization on every quantized Linear's input."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from safetensors import safe_open

    qargs = QuantizationArgs(**args)
    input_scales = {}
    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        for key in f.keys():  # noqa: SIM118
            if key.endswith(".input_scale"):
                input_scales[key.removesuffix(".input_scale")] = f.get_tensor(key).float()

    def hook(module: nn.Module, inputs: tuple, name: str) -> tuple:
        x = inputs[0]
        if qargs.dynamic:
            scale, zero_point = compute_dynamic_scales_and_zp(x, qargs, module)
        else:
            scale, zero_point = input_scales[name], torch.zeros(1)
        return (fake_quantize(x, scale, zero_point, qargs),)

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and "lm_head" not in name:
            module.register_forward_pre_hook(lambda m, i, name=name: hook(m, i, name))


def write_compressed_tensors_group_order(
    hf_model: PreTrainedModel, out_dir: Path, group: int, symmetric: bool, g_idx: bool = True, seed: int = 0
) -> PreTrainedModel:
    """compressed-tensors' pack-quantized W4A16 written here, experts included (llm-compressor
    writes each expert's projections, as the Linear modules they were in transformers 4; on
    transformers 5 compressed-tensors itself cannot reach fused experts). With ``g_idx``, the
    activation ordering "group", which the library no longer writes (0.20 dropped it): each
    projection's inputs are grouped in a random order (``weight_g_idx[perm[i]] = i // group``).
    Scales and zero points are computed per group from the columns in it; compressed-tensors' own
    ``pack_to_int32`` packs the signed integers. The reference takes ``(q - z) * s`` per input."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    generator = torch.Generator().manual_seed(seed)

    def quantize(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        n, k = w.shape
        index = torch.arange(k, dtype=torch.int32) // group
        if g_idx:
            index = torch.empty(k, dtype=torch.int32)
            index[torch.randperm(k, generator=generator)] = torch.arange(k, dtype=torch.int32) // group
        columns = [w[:, index == g] for g in range(k // group)]
        lo = torch.stack([c.amin(1) for c in columns], 1).clamp(max=0)  # [N, G]
        hi = torch.stack([c.amax(1) for c in columns], 1).clamp(min=0)
        if symmetric:
            scales, zeros = (torch.maximum(-lo, hi) / 7.5).clamp(min=1e-5), torch.zeros_like(lo)
        else:
            scales = ((hi - lo) / 15).clamp(min=1e-5)
            zeros = (-8 - lo / scales).round().clamp(-8, 7)
        scales = scales.half().float()  # stored in the model dtype's precision
        s, z = scales[:, index.long()], zeros[:, index.long()]  # [N, K]
        q = (w / s + z).round().clamp(-8, 7)
        tensors = {
            "weight_packed": pack_to_int32(q.to(torch.int8), 4, packed_dim=1),
            "weight_scale": scales.half(),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64),
        }
        if g_idx:
            tensors["weight_g_idx"] = index
        if not symmetric:
            tensors["weight_zero_point"] = pack_to_int32(zeros.to(torch.int8), 4, packed_dim=0)
        return tensors, (q - z) * s

    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group, "symmetric": symmetric}
    if g_idx:
        weights["actorder"] = "group"
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head", "re:.*mlp.gate$"],
    }
    return _write_per_weight(hf_model, out_dir, quantize, config)


def write_compressed_tensors_fp8(hf_model: PreTrainedModel, out_dir: Path, strategy: str) -> PreTrainedModel:
    """compressed-tensors' float-quantized FP8 W8A8 as llm-compressor writes it, experts included
    (each expert's projections: see ``write_compressed_tensors_group_order``): e4m3 weights under
    ``amax / 448`` per output row (``strategy`` "channel", FP8-dynamic), per tensor, or per 16 x 16
    block ("block", its FP8-block scheme); activations rounded at run time per token (per 16-input
    group of a token with blocks). The reference takes the dequantized weights and rounds every
    quantized matmul's input so."""
    block = (16, 16)

    def quantize(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if strategy == "block":
            q, scale, dense = quantize_fp8_blocks(w, block)
            return {"weight": q, "weight_scale": scale}, dense
        amax = w.abs().amax(1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
        scale = (amax / 448).clamp(min=1e-12)
        q = (w / (scale if strategy == "channel" else scale[0])).clamp(-448, 448).to(FP8)
        dense = q.float() * (scale if strategy == "channel" else scale[0])
        return {"weight": q, "weight_scale": scale}, dense

    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
    inputs = FP8_TOKEN_DYNAMIC
    if strategy == "block":
        weights["block_structure"] = list(block)
        inputs = {**FP8_TOKEN_DYNAMIC, "strategy": "group", "group_size": block[1]}
    config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
        },
        "ignore": ["lm_head", "re:.*mlp.gate$"],
    }
    reference = _write_per_weight(hf_model, out_dir, quantize, config)
    qdq = token_group_qdq(block[1]) if strategy == "block" else per_token_qdq
    round_linear_inputs(reference, qdq)
    round_expert_inputs(reference, qdq)
    return reference


FP8_TOKEN_DYNAMIC = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}


# --- Hugging Face "fp8" ---------------------------------------------------------------------


def quantize_fp8_blocks(
    w: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (whole blocks) -> (e4m3 weight, weight_scale_inv [N / bn, K / bk], dequantized)."""
    bn, bk = block
    n, k = w.shape
    tiles = w.reshape(n // bn, bn, k // bk, bk)
    scale = tiles.abs().amax(dim=(1, 3)) / 448
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).to(FP8)
    return q.reshape(n, k), scale, (q.float() * scale[:, None, :, None]).reshape(n, k)


def write_hf_fp8(
    hf_model: PreTrainedModel,
    out_dir: Path,
    block: tuple[int, int] | None,
    calibration: torch.Tensor | None = None,
) -> PreTrainedModel:
    """Hugging Face's "fp8": block-scaled with dynamic activations (block given), else per-tensor
    weights with a static ``input_scale`` from ``calibration``. Experts go per expert, as the
    published Qwen3-MoE-FP8 checkpoints store them."""
    reference = copy.deepcopy(hf_model)
    amax = _observe_input_amax(hf_model, calibration) if block is None else {}
    tensors = {}
    for name, value in hf_model.state_dict().items():
        if LINEAR.match(name):
            module = name.removesuffix(".weight")
            tensors.update(_fp8_tensors(module, value, block, amax))
            reference.get_parameter(name).data.copy_(_fp8_dequantized(tensors, module, block))
        elif match := EXPERTS.match(name):
            reference.get_parameter(name).data.copy_(
                _write_experts(tensors, match, value, block, hf_model.config.model_type)
            )
        else:
            tensors[name] = value.contiguous()
    _save(
        out_dir,
        hf_model,
        tensors,
        {
            "quant_method": "fp8",
            "activation_scheme": "dynamic" if block else "static",
            **({"weight_block_size": list(block)} if block else {}),
        },
    )
    if block is not None:
        round_linear_inputs(reference, token_group_qdq(block[1]))
        round_expert_inputs(reference, token_group_qdq(block[1]))
    else:
        for module_name, module in reference.named_modules():
            if f"{module_name}.input_scale" in tensors:
                scale = tensors[f"{module_name}.input_scale"]
                module.register_forward_pre_hook(lambda _, args, s=scale: (qdq_fp8(args[0], s),))
    return reference.eval()


def _fp8_tensors(
    module: str, w: torch.Tensor, block: tuple[int, int] | None, amax: dict
) -> dict[str, torch.Tensor]:
    if block is not None:
        q, scale, _ = quantize_fp8_blocks(w, block)
        return {f"{module}.weight": q, f"{module}.weight_scale_inv": scale}
    scale = w.abs().max() / 448
    return {
        f"{module}.weight": (w / scale).clamp(-448, 448).to(FP8),
        f"{module}.weight_scale": scale,
        f"{module}.input_scale": amax[module] / 448,
    }


def _fp8_dequantized(tensors: dict, module: str, block: tuple[int, int] | None) -> torch.Tensor:
    q = tensors[f"{module}.weight"].float()
    if block is None:
        return q * tensors[f"{module}.weight_scale"]
    bn, bk = block
    scale = tensors[f"{module}.weight_scale_inv"]
    return (q.reshape(scale.shape[0], bn, scale.shape[1], bk) * scale[:, None, :, None]).reshape(q.shape)


# model_type -> (the published checkpoints' block module, names of gate, up and down per expert).
EXPERT_NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


def _write_experts(
    tensors: dict, match: re.Match, stacked: torch.Tensor, block: tuple[int, int], model_type: str
) -> torch.Tensor:
    """Per-expert FP8 tensors of a stacked transformers parameter, named as the published
    checkpoints of ``model_type`` name them; returns the parameter dequantized."""
    module, (gate, up, down) = EXPERT_NAMES.get(model_type, ("mlp", ("gate_proj", "up_proj", "down_proj")))
    prefix = match["prefix"].replace(".mlp.", f".{module}.")
    dequantized = torch.empty_like(stacked)
    for e, w in enumerate(stacked):
        if match["param"] == "down_proj":
            pieces = [(down, w, slice(None))]
        else:
            i = w.shape[0] // 2
            pieces = [(gate, w[:i], slice(0, i)), (up, w[i:], slice(i, 2 * i))]
        for projection, piece, rows in pieces:
            q, scale, dq = quantize_fp8_blocks(piece, block)
            tensors[f"{prefix}.{e}.{projection}.weight"] = q
            tensors[f"{prefix}.{e}.{projection}.weight_scale_inv"] = scale
            dequantized[e, rows] = dq
    return dequantized


# --- AWQ and GPTQ ---------------------------------------------------------------------------

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble j holds column order[j]


def pack_nibbles(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """values [R, C] in 0..15 -> int32 [R, C / 8], nibble j of word c holding column 8 c + order[j]."""
    v = values.numpy().astype(np.uint32).reshape(values.shape[0], -1, 8)
    words = np.zeros(v.shape[:2], dtype=np.uint32)
    for j, column in enumerate(order):
        words |= v[:, :, column] << np.uint32(4 * j)
    return torch.from_numpy(words.view(np.int32).copy())


def rtn_asymmetric(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K], zeros [N, K / g], scales fp16 [N, K / g]), 4-bit min-max RTN."""
    groups = w.unflatten(1, (-1, group))
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-5).half()
    zeros = (-lo / scales.float()).round().clamp(0, 15)
    q = (groups / scales.float()[..., None] + zeros[..., None]).round().clamp(0, 15)
    return q.flatten(1).int(), zeros.int(), scales


def write_awq(hf_model: PreTrainedModel, out_dir: Path, group: int) -> PreTrainedModel:
    def quantize(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q, zeros, scales = rtn_asymmetric(w, group)
        tensors = {
            "qweight": pack_nibbles(q.t().contiguous(), AWQ_ORDER),  # [K, N / 8]
            "qzeros": pack_nibbles(zeros.t().contiguous(), AWQ_ORDER),  # [K / g, N / 8]
            "scales": scales.t().contiguous(),  # [K / g, N]
        }
        return tensors, (q - zeros.repeat_interleave(group, 1)).float() * scales.float().repeat_interleave(
            group, 1
        )

    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return _write_per_weight(hf_model, out_dir, quantize, config)


def write_gptq(
    hf_model: PreTrainedModel, out_dir: Path, group: int, desc_act: bool = True, seed: int = 0
) -> PreTrainedModel:
    """Symmetric 4-bit GPTQ; with desc_act, inputs visited in a random order per projection and
    groups formed along that order (``g_idx[perm[i]] = i // group``); zeros stored minus one."""
    generator = torch.Generator().manual_seed(seed)

    def quantize(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        n, k = w.shape
        perm = torch.randperm(k, generator=generator) if desc_act else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = torch.arange(k, dtype=torch.int32) // group
        amax = torch.stack([w[:, g_idx == g].abs().amax(1) for g in range(k // group)], 1)  # [N, G]
        scales = (2 * amax / 15).clamp(min=1e-5).half()  # [N, G]
        s = scales.float()[:, g_idx.long()]  # [N, K]
        q = (w / s + 8).round().clamp(0, 15).int()
        tensors = {
            "qweight": pack_nibbles(q.contiguous()).t().contiguous(),  # [K / 8, N]: along K
            "qzeros": pack_nibbles(torch.full((k // group, n), 7)),  # z - 1 = 7
            "scales": scales.t().contiguous(),
            "g_idx": g_idx,
        }
        return tensors, (q - 8).float() * s

    config = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": True}
    return _write_per_weight(hf_model, out_dir, quantize, config)


def _write_per_weight(
    hf_model: PreTrainedModel,
    out_dir: Path,
    quantize: Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]],
    quantization_config: dict,
) -> PreTrainedModel:
    """Every linear weight and every expert's projection through ``quantize`` (w [N, K] ->
    (the format's tensors by suffix, the dequantized weight)), experts one tensor set each, named
    as the published checkpoints of the model type name them; the reference takes the dequantized
    weights."""
    reference = copy.deepcopy(hf_model)
    module_name, (gate, up, down) = EXPERT_NAMES.get(
        hf_model.config.model_type, ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    tensors = {}
    for name, value in hf_model.state_dict().items():
        if LINEAR.match(name):
            quantized, dense = quantize(value)
            tensors.update({f"{name.removesuffix('.weight')}.{k}": v for k, v in quantized.items()})
            reference.get_parameter(name).data.copy_(dense)
        elif match := EXPERTS.match(name):
            prefix = match["prefix"].replace(".mlp.", f".{module_name}.")
            dequantized = torch.empty_like(value)
            for e, w in enumerate(value):
                i = w.shape[0] // 2
                pieces = (
                    [(down, slice(None))]
                    if match["param"] == "down_proj"
                    else [(gate, slice(0, i)), (up, slice(i, 2 * i))]
                )
                for projection, rows in pieces:
                    quantized, dequantized[e, rows] = quantize(w[rows])
                    tensors.update({f"{prefix}.{e}.{projection}.{k}": v for k, v in quantized.items()})
            reference.get_parameter(name).data.copy_(dequantized)
        else:
            tensors[name] = value.contiguous()
    _save(out_dir, hf_model, tensors, quantization_config)
    return reference.eval()


def _save(out_dir: Path, hf_model: PreTrainedModel, tensors: dict, quantization_config: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_model.config.save_pretrained(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
