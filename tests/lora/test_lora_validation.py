"""Every bad LoRA input is refused before it runs, with an error naming the field, and leaves the
engine as it was: the next good request still runs."""

from __future__ import annotations

import copy
import json

import pytest
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.lora.request import LoRARequest

PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
LLAMA = {"num_attention_heads": 4, "num_key_value_heads": 2}


def peft_adapter(hf_model, directory, **config) -> str:
    from peft import LoraConfig, get_peft_model

    get_peft_model(copy.deepcopy(hf_model), LoraConfig(**config)).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def base(make_tiny_model_for_module):
    return make_tiny_model_for_module(LlamaConfig, **LLAMA)


@pytest.fixture(scope="module")
def llm(base):
    return LLM(base[1].model, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def good(base, tmp_path_factory):
    return LoRARequest(
        "good", 1, peft_adapter(base[0], tmp_path_factory.mktemp("good"), r=4, target_modules=["q_proj"])
    )


def generate(llm, lora_request):
    return llm.generate(
        prompt_token_ids=[[1, 2, 3]], sampling_params=PARAMS, lora_request=lora_request, use_tqdm=False
    )


def assert_refused_then_good_runs(llm, good, lora_request, match):
    with pytest.raises(ValueError, match=match):
        generate(llm, lora_request)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(generate(llm, good)[0].outputs[0].token_ids) == PARAMS.max_tokens


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (("", 1, "/x"), "lora_name"),
        (("a", 0, "/x"), "lora_int_id must be an int >= 1"),
        (("a", True, "/x"), "lora_int_id"),
        (("a", 1, ""), "lora_path"),
    ],
)
def test_lora_request_fields_are_checked(fields, match):
    with pytest.raises(ValueError, match=match):
        LoRARequest(*fields)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_loras": 0}, "max_loras must be an int >= 1"),
        ({"max_lora_rank": 0}, "max_lora_rank must be an int >= 1"),
        ({"max_loras": 4, "max_cpu_loras": 2}, r"max_cpu_loras must be an int >= max_loras \(4\)"),
    ],
)
def test_lora_limits_are_checked_before_loading(base, options, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=base[1].model, device="cpu", enable_lora=True, **options).create_engine_config()


def test_lora_request_without_enable_lora_is_refused(base, good):
    plain = LLM(base[1].model, device="cpu")
    with pytest.raises(ValueError, match="enable_lora=True"):
        generate(plain, good)
    assert not plain.llm_engine.has_unfinished_requests()


def test_rank_above_max_lora_rank_is_refused(llm, good, base, tmp_path):
    adapter = peft_adapter(base[0], tmp_path, r=16, target_modules=["q_proj"])
    assert_refused_then_good_runs(llm, good, LoRARequest("big", 2, adapter), "r=16 exceeds max_lora_rank=8")


def test_missing_directory_is_refused(llm, good, tmp_path):
    lora = LoRARequest("gone", 3, str(tmp_path / "nowhere"))
    assert_refused_then_good_runs(llm, good, lora, "lora_path is not a directory")


def test_directory_without_adapter_config_is_refused(llm, good, tmp_path):
    assert_refused_then_good_runs(llm, good, LoRARequest("empty", 4, str(tmp_path)), "no adapter_config.json")


def test_malformed_adapter_config_is_refused(llm, good, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{not json")
    assert_refused_then_good_runs(llm, good, LoRARequest("bad", 5, str(tmp_path)), "not valid JSON")


def test_pickled_weights_are_not_loaded(llm, good, base, tmp_path):
    adapter = peft_adapter(base[0], tmp_path, r=4, target_modules=["q_proj"])
    (tmp_path / "adapter_model.safetensors").rename(tmp_path / "adapter_model.bin")
    assert_refused_then_good_runs(llm, good, LoRARequest("pickle", 6, adapter), "is a pickle")


def test_adapter_of_another_base_model_is_refused(llm, good, make_tiny_model, tmp_path):
    other, _ = make_tiny_model(LlamaConfig, **{**LLAMA, "hidden_size": 32})
    adapter = peft_adapter(other, tmp_path / "other", r=4, target_modules=["q_proj"])
    assert_refused_then_good_runs(llm, good, LoRARequest("other", 7, adapter), "the base model needs")


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"target_modules": ["embed_tokens", "q_proj"]}, "embeddings or the LM head"),
        ({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj"], "use_dora": True}, "DoRA"),
        ({"target_modules": ["q_proj"], "bias": "lora_only"}, "trained biases"),
    ],
)
def test_unsupported_adapter_kinds_are_refused(llm, good, base, tmp_path, config, match):
    adapter = peft_adapter(base[0], tmp_path, r=4, **config)
    assert_refused_then_good_runs(llm, good, LoRARequest("odd", 8, adapter), match)


def test_vocabulary_tensors_are_refused_even_if_the_config_hides_them(llm, good, base, tmp_path):
    adapter = peft_adapter(base[0], tmp_path, r=4, target_modules=["embed_tokens", "q_proj"])
    config_path = tmp_path / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["target_modules"] = ["q_proj"]
    config_path.write_text(json.dumps(config))
    assert_refused_then_good_runs(llm, good, LoRARequest("hidden", 9, adapter), "embeddings or the LM head")


def test_one_int_id_names_one_adapter(llm, good, base, tmp_path):
    adapter = peft_adapter(base[0], tmp_path, r=4, target_modules=["v_proj"])
    lora = LoRARequest("impostor", good.lora_int_id, adapter)
    assert_refused_then_good_runs(
        llm, good, lora, f"lora_int_id {good.lora_int_id} already names adapter 'good'"
    )


def test_one_lora_request_per_prompt(llm, good):
    with pytest.raises(ValueError, match="lora_request has 2 entries for 1 prompts"):
        generate(llm, [good, None])
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        generate(llm, "good")
