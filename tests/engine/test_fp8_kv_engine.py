"""kv_cache_dtype="fp8" through the engine on the CPU (torch attention backend, float32 model).

Oracle: Hugging Face's Llama in float32 with an attention function that quantizes K and V as the
FP8 cache does (``fake_quant``, per layer with the checkpoint's scales, torch's own e4m3 cast),
then runs transformers' eager attention: the engine's greedy tokens must be its argmax and the
engine's logprobs its log-softmax.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface, AttentionMaskInterface, LlamaConfig
from transformers.masking_utils import eager_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs

E4M3_MAX = 448.0
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
PROMPTS = [[3, 17, 42, 99, 7, 150, 23, 64, 5, 88, 121, 9, 30], [11, 12, 13, 140, 2, 77, 56]]


def fake_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an FP8 cache with ``scale`` gives it back, in float32."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def _reference_logprobs(hf_model, scales: list[tuple[float, float]], prompt: list[int], tokens: list[int]):
    """[len(tokens), vocab] log-softmax of HF's next-token logits over prompt + tokens, with K/V
    quantized per layer by ``scales`` (k_scale, v_scale)."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = scales[module.layer_idx]
        key, value = fake_quant(key, k_scale), fake_quant(value, v_scale)
        return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("fp8_kv_reference", attention)
    # The eager (additive, causal) mask: a new name would otherwise get none, as SDPA's causal skip.
    AttentionMaskInterface.register("fp8_kv_reference", eager_mask)
    hf_model.set_attn_implementation("fp8_kv_reference")
    try:
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + tokens])).logits[0].float()
    finally:
        hf_model.set_attn_implementation("eager")
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]


def _assert_matches_reference(outputs, hf_model, scales) -> None:
    for prompt, output in zip(PROMPTS, outputs):
        completion = output.outputs[0]
        reference = _reference_logprobs(hf_model, scales, prompt, list(completion.token_ids))
        assert completion.token_ids == reference.argmax(-1).tolist()
        for row, token, entry in zip(reference, completion.token_ids, completion.logprobs):
            assert abs(entry[token].logprob - row[token].item()) < 1e-3


def _llm(model_dir: str, **kwargs) -> LLM:
    return LLM(
        model_dir, device="cpu", dtype="float32", attention_backend="torch", block_size=4,
        num_kv_blocks=64, swap_space=0.01, **kwargs,
    )  # fmt: skip


def _generate(llm: LLM):
    return llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, use_tqdm=False)


@pytest.fixture
def tiny_llama(make_tiny_model):
    return make_tiny_model(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)


def test_fp8_cache_without_checkpoint_scales_uses_one(tiny_llama) -> None:
    """No scale in the checkpoint: every layer quantizes with 1.0 (vLLM's default). The output
    differs from the float32 cache's, which the unit-scale oracle tells apart."""
    hf_model, model_config = tiny_llama
    outputs = _generate(_llm(model_config.model, kv_cache_dtype="fp8"))
    _assert_matches_reference(outputs, hf_model, [(1.0, 1.0)] * 2)
    exact = _generate(_llm(model_config.model))
    fp8_lp = [o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob for o in outputs]
    exact_lp = [o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob for o in exact]
    assert fp8_lp != exact_lp
    # e4m3's 3 mantissa bits: the first token of each prompt is the float32 cache's.
    assert [o.outputs[0].token_ids[0] for o in outputs] == [o.outputs[0].token_ids[0] for o in exact]


def test_checkpoint_kv_scales_are_loaded_and_used(tiny_llama) -> None:
    """k_scale / v_scale per layer in the safetensors (compressed-tensors' names) change the
    result exactly as the oracle with those scales says; small scales saturate K at 448."""
    hf_model, model_config = tiny_llama
    scales = [(0.004, 0.01), (0.5, 2.0)]
    path = Path(model_config.model) / "model.safetensors"
    tensors = load_file(path)
    for layer, (k_scale, v_scale) in enumerate(scales):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k_scale)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v_scale)
    save_file(tensors, path, metadata={"format": "pt"})

    outputs = _generate(_llm(model_config.model, kv_cache_dtype="fp8"))
    _assert_matches_reference(outputs, hf_model, scales)
    # The scales matter: the unit-scale oracle does not give these logprobs.
    unit = _reference_logprobs(hf_model, [(1.0, 1.0)] * 2, PROMPTS[0], list(outputs[0].outputs[0].token_ids))
    token = outputs[0].outputs[0].token_ids[0]
    assert abs(outputs[0].outputs[0].logprobs[0][token].logprob - unit[0, token].item()) > 1e-3


def test_fp8_cache_holds_more_blocks_for_the_same_memory(tiny_llama) -> None:
    """The CPU sizes the cache from kv_cache_memory: one byte per element instead of float32's four."""
    _, model_config = tiny_llama
    kwargs = dict(device="cpu", dtype="float32", attention_backend="torch", kv_cache_memory=1 << 20)
    auto = LLM(model_config.model, **kwargs).llm_engine.num_gpu_blocks
    fp8 = LLM(model_config.model, kv_cache_dtype="fp8", **kwargs).llm_engine.num_gpu_blocks
    assert fp8 == 4 * auto


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype='fp8_e5m2' is not supported"),
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype must be one of"),
        ({"kv_cache_dtype": "fp8", "batch_invariant": True}, "batch_invariant must be False"),
        ({"kv_cache_dtype": "fp8", "attention_backend": "cpu"}, "not supported by the 'cpu' attention"),
    ],
)
def test_refusals_name_the_field(tiny_llama, kwargs: dict, match: str) -> None:
    _, model_config = tiny_llama
    with pytest.raises(ValueError, match=match):
        LLM(model_config.model, device="cpu", dtype="float32", **kwargs)


def test_mla_refuses_an_fp8_cache(tiny_llama) -> None:
    _, model_config = tiny_llama
    config = EngineArgs(model=model_config.model, device="cpu", dtype="float32").create_engine_config()
    hf_config = model_config.hf_config.__class__.from_dict(model_config.hf_config.to_dict())
    hf_config.kv_lora_rank, hf_config.qk_rope_head_dim = 16, 8
    mla = dataclasses.replace(config.model_config, hf_config=hf_config)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported with multi-head latent"):
        dataclasses.replace(
            config, model_config=mla, cache_config=dataclasses.replace(config.cache_config, cache_dtype="fp8")
        )


def test_cli_takes_kv_cache_dtype() -> None:
    import argparse

    args = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--kv-cache-dtype", "fp8"])
    assert EngineArgs.from_cli_args(args).kv_cache_dtype == "fp8"
