"""Quantized checkpoints (fp8, compressed-tensors, awq, gptq, online fp8) on the CPU in float32:
pagedllm's greedy output equals transformers' ``generate`` on the same model with the weights the
tool itself dequantizes (and the activations rounded as the format implies), on two or three
architectures; and every checkpoint that cannot be served is refused before serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig, PreTrainedModel

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.model_loader import get_model
from tests.model_loader.quant_writers import (
    per_token_qdq,
    round_expert_inputs,
    round_linear_inputs,
    write_awq,
    write_compressed_tensors,
    write_compressed_tensors_group_order,
    write_gptq,
    write_hf_fp8,
)
from tests.model_loader.quantized_checks import (
    ARCHITECTURES,
    COMPRESSED_TENSORS_SCHEMES,
    CPU,
    MAX_TOKENS,
    MOE_WRITERS,
    assert_same_greedy,
    assert_same_logits,
    calibration_ids,
    make_prompts,
)


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
@pytest.mark.parametrize("scheme", sorted(COMPRESSED_TENSORS_SCHEMES))
def test_compressed_tensors_checkpoints_generate_as_hf_dequantized(
    tiny, paged_runner, architecture, scheme
) -> None:
    hf_model, model_dir = tiny(architecture)
    fields, fmt = COMPRESSED_TENSORS_SCHEMES[scheme]
    reference = write_compressed_tensors(
        hf_model, model_dir, fields, fmt, calibration_ids(hf_model.config.vocab_size)
    )
    assert_same_greedy(reference, model_dir, paged_runner)
    if (fields.get("input_activations") or {}).get("type") != "int":
        # Not with int8 activations: a 0.5-step tie that float noise upstream (a summation order)
        # tips either way moves a logit by a whole step now and then; their rounding is checked
        # bit for bit against compressed-tensors' own (test_int8_activation_rounding_...).
        assert_same_logits(reference, model_dir, paged_runner)


@pytest.mark.parametrize("architecture", [*sorted(ARCHITECTURES), "qwen3_moe", "mixtral"])
def test_fp8_block_scaled_checkpoints_generate_as_hf_dequantized(tiny, paged_runner, architecture) -> None:
    hf_model, model_dir = tiny(architecture)
    reference = write_hf_fp8(hf_model, model_dir, block=(16, 16))
    assert_same_greedy(reference, model_dir, paged_runner)


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_fp8_per_tensor_static_checkpoints_generate_as_hf_dequantized(
    tiny, paged_runner, architecture
) -> None:
    hf_model, model_dir = tiny(architecture)
    reference = write_hf_fp8(
        hf_model, model_dir, block=None, calibration=calibration_ids(hf_model.config.vocab_size)
    )
    assert_same_greedy(reference, model_dir, paged_runner)


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_awq_checkpoints_generate_as_hf_dequantized(tiny, paged_runner, architecture) -> None:
    hf_model, model_dir = tiny(architecture)
    assert_same_greedy(write_awq(hf_model, model_dir, group=32), model_dir, paged_runner)


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
@pytest.mark.parametrize("desc_act", [True, False])
def test_gptq_checkpoints_generate_as_hf_dequantized(tiny, paged_runner, architecture, desc_act) -> None:
    hf_model, model_dir = tiny(architecture)
    reference = write_gptq(hf_model, model_dir, group=16 if desc_act else 32, desc_act=desc_act)
    assert_same_greedy(reference, model_dir, paged_runner)


def _online_fp8_reference(hf_model: PreTrainedModel) -> PreTrainedModel:
    """Each linear weight rounded per output row under amax / 448, inputs per token."""
    import copy

    reference = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if (name.endswith("_proj.weight") and "embed" not in name) or name.endswith(
                ("gate_up_proj", "down_proj")
            ):
                scale = param.abs().amax(-1, keepdim=True) / 448
                param.copy_((param / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale)
    round_linear_inputs(reference, per_token_qdq)
    round_expert_inputs(reference, per_token_qdq)
    return reference.eval()


@pytest.mark.parametrize("architecture", ["llama", "qwen3_moe"])
def test_online_fp8_of_a_dense_checkpoint_generates_as_hf_rounded(tiny, paged_runner, architecture) -> None:
    hf_model, model_dir = tiny(architecture)
    hf_model.save_pretrained(model_dir)
    assert_same_greedy(_online_fp8_reference(hf_model), model_dir, paged_runner, quantization="fp8")


# --- refused before serving ------------------------------------------------------------------


def _load(model_dir: Path, quantization: str = "auto", tp_size: int = 1) -> None:
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_config = ModelConfig(
        str(model_dir), str(model_dir), hf_config, torch.float32, 256, quantization=quantization
    )
    get_model(model_config, "auto", CPU, TorchAttentionBackend)


def _edit_config(model_dir: Path, **fields: object) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"].update(fields)
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.fixture
def awq_dir(tiny) -> Path:
    hf_model, model_dir = tiny("llama")
    write_awq(hf_model, model_dir, group=32)
    return model_dir


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"quant_method": "bitsandbytes"},
            r"quantization_config.quant_method 'bitsandbytes' is not supported",
        ),
        ({"bits": 3}, r"quantization_config.bits must be 4"),
        ({"group_size": 12}, r"quantization_config.group_size must be a positive multiple of 8"),
        ({"version": "gemv"}, r"quantization_config.version must be 'gemm'"),
    ],
)
def test_impossible_quantization_configs_are_refused_naming_the_field(awq_dir, fields, message) -> None:
    _edit_config(awq_dir, **fields)
    with pytest.raises(ValueError, match=message):
        _load(awq_dir)


def test_gptq_bit_widths_other_than_4_and_8_are_refused(tiny) -> None:
    hf_model, model_dir = tiny("llama")
    write_gptq(hf_model, model_dir, group=16)
    _edit_config(model_dir, bits=3)
    with pytest.raises(ValueError, match=r"quantization_config.bits must be one of \[4, 8\], got 3"):
        _load(model_dir)


def test_a_missing_scale_tensor_is_refused_naming_it(tiny) -> None:
    hf_model, model_dir = tiny("llama")
    write_hf_fp8(hf_model, model_dir, block=(16, 16))
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight_scale_inv"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"model.layers.1.self_attn.qkv_proj.weight_scale_inv \(from k_proj\)"
    ):
        _load(model_dir)


def test_quantization_argument_must_match_the_checkpoint(awq_dir, tiny) -> None:
    with pytest.raises(ValueError, match=r"quantization='gptq' does not match .*quant_method 'awq'"):
        _load(awq_dir, quantization="gptq")
    hf_model, dense_dir = tiny("qwen3")
    hf_model.save_pretrained(dense_dir)
    with pytest.raises(ValueError, match=r"quantization='awq' needs a checkpoint quantized with it"):
        _load(dense_dir, quantization="awq")


def test_an_unknown_quantization_argument_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig("m", "m", LlamaConfig(), torch.float32, 16, quantization="int3")


def test_block_scales_that_a_merged_projection_cuts_are_refused(tiny) -> None:
    hf_model, model_dir = tiny("llama")
    write_hf_fp8(hf_model, model_dir, block=(16, 16))
    _edit_config(model_dir, weight_block_size=[48, 16])  # q has 64 rows: 48-row blocks cut it
    with pytest.raises(
        ValueError, match=r"weight_block_size\[0\]=48 does not divide QKVParallelLinear's output"
    ):
        _load(model_dir)


def test_a_group_size_that_cuts_a_rank_shard_is_refused_naming_the_sizes_that_work(monkeypatch) -> None:
    from pagedllm.layers import linear
    from pagedllm.layers.quantization.wna16 import AWQMethod, IntWeightScheme

    monkeypatch.setattr(linear, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(linear, "get_tensor_model_parallel_rank", lambda: 0)
    down_proj = linear.RowParallelLinear(96, 64, bias=False)  # 48 inputs per rank
    message = (
        r"group_size=32 does not divide RowParallelLinear's input shard of 48 features "
        r"\(96 over tensor_parallel_size=2\); tensor_parallel_size in \[1, 3\] works"
    )
    with pytest.raises(ValueError, match=message):
        AWQMethod(IntWeightScheme(4, 32, symmetric=False)).create_weights(down_proj)


@pytest.mark.slow
@pytest.mark.parametrize(
    "checkpoint",
    [
        "gptq-desc-act",
        "compressed-tensors-w4a16-asym",
        "compressed-tensors-group-order",
        "fp8-block",
        # (Not FP8 experts: per-token activation scales over a rank's share of down's inputs differ
        # from the whole's, as in vLLM, so two ranks round differently.)
        *(f"qwen3_moe-{name}" for name in ("awq", "gptq-desc-act", "compressed-tensors-group-order")),
    ],
)
def test_two_ranks_give_the_greedy_tokens_of_one_on_a_quantized_checkpoint(tiny, checkpoint) -> None:
    from pagedllm import LLM, SamplingParams

    moe_checkpoint = checkpoint.removeprefix("qwen3_moe-")
    hf_model, model_dir = tiny("qwen3_moe" if moe_checkpoint != checkpoint else "llama")
    if moe_checkpoint != checkpoint:  # every expert quantized, their shards cut at 16 features
        MOE_WRITERS[moe_checkpoint](hf_model, model_dir)
    elif checkpoint == "gptq-desc-act":
        write_gptq(hf_model, model_dir, group=16)
    elif checkpoint == "fp8-block":
        write_hf_fp8(hf_model, model_dir, block=(16, 16))
    elif checkpoint == "compressed-tensors-group-order":
        write_compressed_tensors_group_order(hf_model, model_dir, group=16, symmetric=False)
    else:
        fields, fmt = COMPRESSED_TENSORS_SCHEMES["w4a16-asym-g16"]
        write_compressed_tensors(
            hf_model, model_dir, fields, fmt, calibration_ids(hf_model.config.vocab_size)
        )
    prompts = make_prompts(hf_model.config.vocab_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = {}
    for tp_size in (1, 2):
        llm = LLM(
            str(model_dir), device="cpu", dtype="float32", swap_space=0.01, tensor_parallel_size=tp_size
        )
        try:
            results = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
            outputs[tp_size] = [r.outputs[0].token_ids for r in results]
        finally:
            llm.llm_engine.shutdown()
    assert outputs[2] == outputs[1]


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_compressed_tensors_group_activation_order_generates_as_hf_dequantized(
    tiny, paged_runner, architecture, symmetric
) -> None:
    """actorder "group": each input's group from weight_g_idx (older llm-compressor's GPTQ)."""
    hf_model, model_dir = tiny(architecture)
    reference = write_compressed_tensors_group_order(hf_model, model_dir, group=16, symmetric=symmetric)
    assert_same_greedy(reference, model_dir, paged_runner)
    assert_same_logits(reference, model_dir, paged_runner)


@pytest.mark.parametrize("strategy", ["token", "tensor"])
def test_int8_activation_rounding_is_compressed_tensors(strategy) -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from pagedllm.layers.quantization.int8 import qdq_int8

    args = QuantizationArgs(
        num_bits=8, type="int", strategy=strategy, dynamic=strategy == "token", symmetric=True
    )
    generator = torch.Generator().manual_seed(0)
    for tokens in (1, 5, 13, 64):
        x = (
            torch.randn(1, tokens, 96, generator=generator)
            * torch.rand(1, tokens, 1, generator=generator)
            * 4
        )
        x[0, 0, :3] = 0.0  # zeros, and a token of zeros where there is one
        x[0, -1] *= 1e-40  # a token whose scale is below the float32 epsilon (not the zero guard's)
        if strategy == "token":
            scale, zero_point = compute_dynamic_scales_and_zp(x, args, torch.nn.Linear(96, 96))
            ours = qdq_int8(x[0], None)
        else:  # static: the checkpoint's input_scale
            scale, zero_point = torch.tensor([0.0173]), torch.zeros(1, dtype=torch.int8)
            ours = qdq_int8(x[0], scale)
        torch.testing.assert_close(ours, fake_quantize(x, scale, zero_point, args)[0], atol=0, rtol=0)


@pytest.mark.parametrize(
    ("weights", "inputs", "message"),
    [
        ({"num_bits": 4}, {}, r"weights.num_bits must be 8 with int8 activations.*4"),
        (
            {"strategy": "group", "group_size": 32},
            {},
            r"weights.strategy must be 'channel' or 'tensor'.*'group'",
        ),
        ({}, {"symmetric": False}, r"input_activations.symmetric must be true.*False"),
        (
            {},
            {"strategy": "tensor", "dynamic": True},
            r"input_activations.strategy/dynamic must be dynamic token or static tensor",
        ),
    ],
)
def test_int8_schemes_the_layers_cannot_run_are_refused_naming_the_field(weights, inputs, message) -> None:
    from pagedllm.layers.quantization.compressed_tensors import CompressedTensorsConfig

    fields, fmt = COMPRESSED_TENSORS_SCHEMES["w8a8-int8-channel-dynamic"]
    group = {"targets": ["Linear"], "weights": fields["weights"] | weights}
    group["input_activations"] = fields["input_activations"] | inputs
    with pytest.raises(ValueError, match=r"quantization_config.config_groups.group_0." + message):
        CompressedTensorsConfig.from_config({"format": fmt, "config_groups": {"group_0": group}})


@pytest.mark.parametrize("actorder", ["weight", "static", None])
def test_compressed_tensors_activation_orders_without_a_permutation_load_as_none(actorder) -> None:
    """ "weight" is compressed-tensors' name for "static" (its alias): groups in place."""
    from pagedllm.layers.quantization.compressed_tensors import CompressedTensorsConfig

    fields, fmt = COMPRESSED_TENSORS_SCHEMES["w4a16-asym-g32-actorder-static"]
    weights = fields["weights"] | {"actorder": actorder}
    config = {"format": fmt, "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    method = CompressedTensorsConfig.from_config(config).get_linear_method(
        None, ["model.layers.0.mlp.up_proj"]
    )
    assert not method.g_idx and "weight_g_idx" not in method.tensor_names


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (
            {"actorder": "sideways"},
            r"weights.actorder must be null, 'weight' \('static'\) or 'group' \('dynamic'\).*'sideways'",
        ),
        (
            {"actorder": "group", "strategy": "channel"},
            r"weights.strategy must be 'group' with actorder 'group'.*'channel'",
        ),
    ],
)
def test_impossible_activation_orders_are_refused_naming_the_field(weights, message) -> None:
    from pagedllm.layers.quantization.compressed_tensors import CompressedTensorsConfig

    fields, fmt = COMPRESSED_TENSORS_SCHEMES["w4a16-asym-g32-actorder-static"]
    config = {
        "format": fmt,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": fields["weights"] | weights}},
    }
    with pytest.raises(ValueError, match=r"quantization_config.config_groups.group_0." + message):
        CompressedTensorsConfig.from_config(config)


def test_a_bad_quantization_config_fails_the_engine_before_any_worker_starts(awq_dir) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    _edit_config(awq_dir, zero_point=False)
    with pytest.raises(ValueError, match=r"quantization_config.zero_point must be true"):
        EngineArgs(model=str(awq_dir), device="cpu").create_engine_config()


def test_the_startup_summary_names_the_checkpoint_quantization(awq_dir) -> None:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.utils import engine_summary

    config = EngineArgs(model=str(awq_dir), device="cpu").create_engine_config()
    assert "quantization awq," in engine_summary(config, num_gpu_blocks=8, load_seconds=0.0)


def test_a_checkpoint_method_asked_of_a_gguf_file_is_refused() -> None:
    from pagedllm.model_loader.quantized import resolve_quantization

    model_config = ModelConfig("m.gguf", "m", LlamaConfig(), torch.float32, 16, quantization="fp8")
    with pytest.raises(ValueError, match=r"quantization='fp8' applies to safetensors checkpoints"):
        resolve_quantization(model_config)


@pytest.mark.parametrize("writer", ["awq", "fp8-block"])
def test_dummy_weights_fill_a_quantized_layout(tiny, writer) -> None:
    """load_format="dummy" (benchmarks without a checkpoint) gives quantized layers values in range."""
    hf_model, model_dir = tiny("llama")
    if writer == "awq":
        write_awq(hf_model, model_dir, group=32)
    else:
        write_hf_fp8(hf_model, model_dir, (16, 16))
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_config = ModelConfig(str(model_dir), str(model_dir), hf_config, torch.float32, 256)
    model = get_model(model_config, "dummy", CPU, TorchAttentionBackend)
    weight = model.model.layers[0].mlp.down_proj.weight
    assert weight.shape == (64, 128) and torch.isfinite(weight).all()
