"""The OpenAI-compatible server with the embedded SmolLM2, driven by the official ``openai`` client
(completions, chat, streaming, n, stop, logprobs, usage) and by raw HTTP for the errors."""

from __future__ import annotations

import http.client
import json

import openai
import pytest

API_KEY = "sk-test-key"
MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 64 * 1024
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(launch_server, smollm2_gguf):
    # The key comes through PAGEDLLM_API_KEY, the way a deployment passes a secret.
    return launch_server(
        [
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-request-body-bytes",
            str(MAX_BODY_BYTES),
            "--swap-space",
            "0.1",
        ],
        api_key=API_KEY,
    )


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def skip_if_unsupported(call):
    """Run call(); skip the test when the engine does not implement the option yet (501)."""
    try:
        return call()
    except openai.APIStatusError as e:
        if e.status_code == 501:
            pytest.skip(f"the engine does not implement this yet: {e.message}")
        raise


# --- the routes -----------------------------------------------------------------------------


def test_models_health_version(server, client, model):
    assert model == "SmolLM2-135M-Instruct"
    card = client.models.list().data[0]
    assert card.object == "model" and card.owned_by == "pagedllm"
    assert server.request("GET", "/health")[0] == 200
    status, _, body = server.request("GET", "/version")
    assert status == 200 and json.loads(body)["version"]


def test_completion_text_and_usage(client, model, smollm2_tokenizer):
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    assert completion.model == model and completion.created > 0
    [choice] = completion.choices
    assert choice.index == 0 and choice.text.strip() and choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage.prompt_tokens == len(smollm2_tokenizer(PROMPT)["input_ids"])
    assert 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_prompt_forms_and_choice_indices(client, model, smollm2_tokenizer):
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    token_ids = smollm2_tokenizer(PROMPT)["input_ids"]
    by_ids = client.completions.create(model=model, prompt=token_ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    prompts = [PROMPT, "One, two, three,"]
    several = client.completions.create(
        model=model,
        prompt=prompts,
        n=2,
        max_tokens=4,
        temperature=0.8,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    # Choice i * n + j is prompt i's sample j.
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.usage.prompt_tokens == sum(len(smollm2_tokenizer(p)["input_ids"]) for p in prompts)
    assert several.usage.completion_tokens == 4 * 4


def test_chat_completion(client, model):
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0)
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    [choice] = chat.choices
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert chat.usage.prompt_tokens > 20  # the template's system prompt and markers


def test_streamed_completion_equals_the_non_streamed_one_with_the_same_seed(client, model):
    kwargs = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.9, "seed": 7}
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.id == chunks[0].id and c.object == "text_completion" for c in chunks)
    text = "".join(choice.text for c in chunks for choice in c.choices)
    assert text == full.choices[0].text
    finish_reasons = [choice.finish_reason for c in chunks for choice in c.choices if choice.finish_reason]
    assert finish_reasons == [full.choices[0].finish_reason]
    # The last chunk carries the usage and no choice; the others carry usage: null.
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_chat_equals_the_non_streamed_one_for_each_of_n_choices(client, model):
    kwargs = {"model": model, "messages": MESSAGES, "max_tokens": 10, "temperature": 1.0, "seed": 3, "n": 2}
    full = client.chat.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1]
    texts, roles, finish_reasons = ["", ""], [None, None], [None, None]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk" and chunk.usage is None
        for choice in chunk.choices:
            roles[choice.index] = roles[choice.index] or choice.delta.role
            texts[choice.index] += choice.delta.content or ""
            finish_reasons[choice.index] = finish_reasons[choice.index] or choice.finish_reason
    assert roles == ["assistant", "assistant"]
    assert texts == [c.message.content for c in full.choices]
    assert finish_reasons == [c.finish_reason for c in full.choices]


def test_stop_strings_end_the_text_before_them(client, model):
    unstopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    text = unstopped.choices[0].text
    assert " " in text.strip(), "the test needs an output with two words"
    stop = text.strip().split(" ")[1]
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == stopped.choices[0].text


def test_completion_logprobs(client, model):
    completion = skip_if_unsupported(
        lambda: client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    )
    choice = completion.choices[0]
    logprobs = choice.logprobs
    num_tokens = completion.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == num_tokens
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    # Greedy: each chosen token is the most likely one.
    for token, token_logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert max(top.values()) == pytest.approx(token_logprob) and token in top
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    chunks = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, stream=True
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices]
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    assert [o for lp in streamed for o in lp.text_offset] == logprobs.text_offset


def test_completion_top_logprobs_list_the_sampled_token_too(client, model):
    """As vLLM's: a sampled token outside the top ``logprobs`` is added to them."""
    completion = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=2.0, seed=7, logprobs=1
    )
    logprobs = completion.choices[0].logprobs
    for token, token_logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert top[token] == pytest.approx(token_logprob) and len(top) <= 2
    # At temperature 2 some sampled tokens are not the most likely: those positions list two.
    assert any(len(top) == 2 for top in logprobs.top_logprobs)


def test_echo_returns_the_prompt_with_its_logprobs(client, model):
    kwargs = {"model": model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True}
    plain = client.completions.create(**{**kwargs, "echo": False})
    echoed = skip_if_unsupported(lambda: client.completions.create(**kwargs, logprobs=1))
    text = echoed.choices[0].text
    assert text == PROMPT + plain.choices[0].text
    logprobs = echoed.choices[0].logprobs
    num_tokens = echoed.usage.prompt_tokens + echoed.usage.completion_tokens
    assert len(logprobs.tokens) == num_tokens and "".join(logprobs.tokens) == text
    # The first prompt token has no logprob: nothing comes before it.
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp is not None for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(num_tokens)]
    streamed = client.completions.create(**kwargs, logprobs=1, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text


def test_chat_logprobs_streamed_and_not(client, model):
    kwargs = {"model": model, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    chat = skip_if_unsupported(
        lambda: client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    chunks = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2, stream=True)
    streamed = [
        entry.token
        for c in chunks
        for choice in c.choices
        if choice.logprobs
        for entry in choice.logprobs.content
    ]
    assert streamed == [entry.token for entry in content]


def test_vllm_extra_sampling_fields(client, model):
    completion = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0.7,
        seed=0,
        extra_body={"top_k": 5, "min_p": 0.05, "ignore_eos": True, "min_tokens": 5},
    )
    assert completion.usage.completion_tokens == 5
    penalized = skip_if_unsupported(
        lambda: client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            extra_body={"repetition_penalty": 1.2},
        )
    )
    assert penalized.usage.completion_tokens >= 1


def test_user_request_id_is_used_and_echoed(server, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2}
    status, headers, response = server.request("POST", "/v1/completions", body, {"X-Request-Id": "abc-123"})
    assert status == 200 and headers["x-request-id"] == "abc-123"
    assert json.loads(response)["id"] == "cmpl-abc-123"


# --- errors ----------------------------------------------------------------------------------


def assert_error(response: tuple[int, dict, bytes], status: int, param: str | None = None) -> dict:
    """The OpenAI error shape, with the status and (when given) the field named."""
    code, _, body = response
    assert code == status, body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", API_KEY, f"Basic {API_KEY}"])
def test_a_missing_or_wrong_api_key_is_401_and_costs_no_engine_work(server, model, authorization):
    before = server.metrics()["pagedllm:prompt_tokens_total"]
    headers = {"Authorization": authorization} if authorization else {}
    for path, body in [("/v1/completions", {"model": model, "prompt": PROMPT}), ("/v1/models", None)]:
        response = server.request("POST" if body else "GET", path, body, headers, authorize=False)
        assert assert_error(response, 401)["code"] == "invalid_api_key"
    assert server.request("GET", "/health", authorize=False)[0] == 200  # only /v1 needs the key
    assert server.metrics()["pagedllm:prompt_tokens_total"] == before


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "temperature": -1}, "temperature"),
        ({"prompt": PROMPT, "top_p": 0}, "top_p"),
        ({"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
        ({"prompt": PROMPT, "n": 0}, "n"),
        ({"prompt": PROMPT, "logprobs": 50}, "logprobs"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_a_bad_completion_request_is_400_naming_the_field(server, model, body, param):
    assert_error(server.request("POST", "/v1/completions", {"model": model, **body}), 400, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ],
)
def test_a_bad_chat_request_is_400_naming_the_field(server, model, body, param):
    assert_error(server.request("POST", "/v1/chat/completions", {"model": model, **body}), 400, param)


def test_invalid_json_is_400(server):
    assert_error(server.request("POST", "/v1/completions", b"{not json"), 400)


def test_a_prompt_over_max_model_len_is_400_with_both_lengths(server, model):
    prompt = "hello " * (MAX_MODEL_LEN + 10)
    error = assert_error(server.request("POST", "/v1/completions", {"model": model, "prompt": prompt}), 400)
    assert str(MAX_MODEL_LEN) in error["message"] and error["code"] == "context_length_exceeded"
    num_tokens = int(error["message"].split(" has ")[1].split(" ")[0])
    assert num_tokens > MAX_MODEL_LEN
    # The prompt fits but the completion would not.
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN}
    assert_error(server.request("POST", "/v1/completions", body), 400, "max_tokens")


def test_a_body_over_the_limit_is_413(server, model):
    body = {"model": model, "prompt": "x" * MAX_BODY_BYTES}
    error = assert_error(server.request("POST", "/v1/completions", body), 413)
    assert error["code"] == "request_too_large"
    # Without a Content-Length (chunked), the limit holds while the body is read.
    connection = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=30)
    chunks = (json.dumps(body)[i : i + 4096].encode() for i in range(0, MAX_BODY_BYTES + 100, 4096))
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    connection.request("POST", "/v1/completions", body=chunks, headers=headers, encode_chunked=True)
    response = connection.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
    connection.close()


def test_an_unknown_model_or_route_is_404(server):
    error = assert_error(server.request("POST", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert_error(server.request("GET", "/v1/nothing-here"), 404)


def test_the_server_is_idle_and_its_blocks_free_after_the_tests(server):
    metrics = server.wait_until_idle()
    assert metrics["pagedllm:num_free_gpu_blocks"] == metrics["pagedllm:num_gpu_blocks"]
    assert metrics["pagedllm:num_aborted_requests_total"] == 0
    assert metrics["pagedllm:time_to_first_token_seconds_count"] > 0
    assert metrics["pagedllm:generation_tokens_total"] > 0
