"""LoRA adapters through the server, driven by the official ``openai`` client: a request's model
field picks the adapter (greedy output = PEFT's merged model), ``/v1/models`` lists adapters with
their base as parent, adapters load and unload at run time behind the API key, and an unknown
model is a 404."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

API_KEY = "lora-key"
MAX_TOKENS = 6
PROMPT = [5, 17, 42, 8, 99, 3, 64]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapter_dirs(hf_model, tmp_path_factory, save_peft_adapter):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "sql": save_peft_adapter(hf_model, root / "sql", 4, ["q_proj", "v_proj"], alpha=32.0, seed=1),
        "chat": save_peft_adapter(hf_model, root / "chat", 8, ["o_proj", "down_proj"], alpha=32.0, seed=2),
        "late": save_peft_adapter(hf_model, root / "late", 2, ["gate_proj", "up_proj"], alpha=32.0, seed=3),
    }


@pytest.fixture(scope="module")
def server(launch_server, tiny_server_args, adapter_dirs):
    chat_module = json.dumps({"name": "chat", "path": adapter_dirs["chat"]})
    lora_args = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--dtype", "float32"]
    lora_args += ["--lora-modules", f"sql={adapter_dirs['sql']}", chat_module]
    return launch_server([*tiny_server_args, "--served-model-name", "base", *lora_args], api_key=API_KEY)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def completion_tokens(client: openai.OpenAI, model: str) -> list[int]:
    """The greedy completion's token ids (the tiny model has no tokenizer: logprobs name them)."""
    response = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0
    )
    return [int(token.removeprefix("token_id:")) for token in response.choices[0].logprobs.tokens]


def test_models_lists_adapters_with_their_base_as_parent(client):
    models = {model.id: model for model in client.models.list().data}
    assert {"base", "sql", "chat"} <= set(models)
    assert models["sql"].parent == models["chat"].parent == "base"
    assert getattr(models["base"], "parent", None) is None
    assert client.models.retrieve("sql").parent == "base"


def test_the_model_field_picks_the_adapter(client, hf_model, adapter_dirs, peft_merged, hf_greedy_tokens):
    for name in ("sql", "chat"):
        expected = hf_greedy_tokens(peft_merged(hf_model, adapter_dirs[name]), PROMPT, MAX_TOKENS)
        assert completion_tokens(client, name) == expected, name
    base = completion_tokens(client, "base")
    assert base == hf_greedy_tokens(hf_model, PROMPT, MAX_TOKENS)
    assert base != completion_tokens(client, "sql")


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def test_load_and_unload_at_run_time(server, client, hf_model, adapter_dirs, peft_merged, hf_greedy_tokens):
    load = {"lora_name": "late", "lora_path": adapter_dirs["late"]}
    assert server.request("POST", "/v1/load_lora_adapter", load, authorize=False)[0] == 401
    status, _, body = server.request("POST", "/v1/load_lora_adapter", load)
    assert status == 200, body
    assert "late" in {model.id for model in client.models.list().data}
    expected = hf_greedy_tokens(peft_merged(hf_model, adapter_dirs["late"]), PROMPT, MAX_TOKENS)
    assert completion_tokens(client, "late") == expected
    # Loading the same name again is refused; so is a directory that is no adapter.
    assert server.request("POST", "/v1/load_lora_adapter", load)[0] == 400
    status, _, body = server.request(
        "POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}
    )
    assert status == 400 and b"lora_path is not a directory" in body

    unload = {"lora_name": "late"}
    assert server.request("POST", "/v1/unload_lora_adapter", unload, authorize=False)[0] == 401
    assert server.request("POST", "/v1/unload_lora_adapter", unload)[0] == 200
    assert "late" not in {model.id for model in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=2)
    assert server.request("POST", "/v1/unload_lora_adapter", unload)[0] == 404
    # The other adapters are unaffected.
    assert completion_tokens(client, "sql") == hf_greedy_tokens(
        peft_merged(hf_model, adapter_dirs["sql"]), PROMPT, MAX_TOKENS
    )


def test_chat_picks_the_adapter_too(client):
    # The tiny model has no tokenizer, hence no chat template: the 400 says so, after the model
    # field was accepted (an unknown one is a 404 first).
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}])


def test_bad_lora_modules_stop_the_server_before_it_serves(tiny_model_dir):
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.openai.cli import parse_lora_modules
    from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels

    with pytest.raises(ValueError, match="must be name=path or a JSON object"):
        parse_lora_modules(["just-a-name"])
    with pytest.raises(ValueError, match="not a JSON object with name and path"):
        parse_lora_modules(['{"name": "x"}'])
    assert parse_lora_modules(['{"name": "x", "path": "/p", "base_model_name": "b"}', "y=/q"]) == [
        ("x", "/p", "b"),
        ("y", "/q", None),
    ]
    config = EngineArgs(model=tiny_model_dir, device="cpu", enable_lora=True).create_engine_config()
    with pytest.raises(ValueError, match="lora_path is not a directory"):
        OpenAIServingModels(config, "base", [("x", "/nowhere", None)])
    plain = EngineArgs(model=tiny_model_dir, device="cpu").create_engine_config()
    with pytest.raises(ValueError, match="without --enable-lora"):
        OpenAIServingModels(plain, "base", [("x", "/nowhere", None)])
