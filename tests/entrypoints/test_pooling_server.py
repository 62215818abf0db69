"""A ``--runner pooling`` server: /v1/embeddings with the official ``openai`` client (floats and
base64), /v1/score and /score, /v1/rerank and /rerank, equal to HF's pooled hidden states (float32
AutoModel, last token, normalized) and their cosines; every route behind the API key; bad fields
and the wrong kind of request get a 400 naming what."""

from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest
import torch

from tests.pooling.conftest import hf_pooled, save_tiny_decoder

API_KEY = "pool-key"
TEXTS = ["paged attention stores the KV cache in blocks", "bread needs flour", "hi", "the cache is paged"]


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory, smollm2_tokenizer) -> str:
    path = tmp_path_factory.mktemp("embed-model")
    save_tiny_decoder(path, "qwen3", vocab_size=len(smollm2_tokenizer))
    smollm2_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def server(launch_server, embed_model):
    # Steps of 16 tokens: the longer texts are pooled over several chunks.
    args = [embed_model, "--runner", "pooling", "--served-model-name", "tiny-embed", "--dtype", "float32"]
    args += ["--max-model-len", "256", "--swap-space", "0.1", "--enable-chunked-prefill"]
    args += ["--max-num-batched-tokens", "16", "--max-num-seqs", "8"]
    return launch_server(args, api_key=API_KEY)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def want(embed_model, smollm2_tokenizer) -> list[torch.Tensor]:
    """HF's embeddings of TEXTS, tokenized as the server does."""
    return hf_pooled(embed_model, [smollm2_tokenizer(text)["input_ids"] for text in TEXTS])


def _post(server, path: str, body: dict, **kwargs) -> tuple[int, dict]:
    status, _, raw = server.request("POST", path, body, **kwargs)
    return status, json.loads(raw)


def test_openai_client_embeddings_equal_hf_in_floats_and_base64(client, want, smollm2_tokenizer) -> None:
    # Without encoding_format the client asks for base64 and decodes it itself.
    for encoding_format in (openai.NOT_GIVEN, "float", "base64"):
        response = client.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format=encoding_format)
        assert [d.index for d in response.data] == [0, 1, 2, 3]
        for data, expected in zip(response.data, want):
            embedding = data.embedding
            if encoding_format == "base64":  # asked for: the client hands the string over
                embedding = np.frombuffer(base64.b64decode(embedding), dtype="<f4").tolist()
            torch.testing.assert_close(torch.tensor(embedding), expected, atol=2e-5, rtol=1e-4)
    num_tokens = sum(len(smollm2_tokenizer(text)["input_ids"]) for text in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens
    by_ids = client.embeddings.create(model="tiny-embed", input=smollm2_tokenizer(TEXTS[0])["input_ids"])
    torch.testing.assert_close(torch.tensor(by_ids.data[0].embedding), want[0], atol=2e-5, rtol=1e-4)


def test_pooling_route_returns_the_same_vectors(server, want) -> None:
    status, body = _post(server, "/pooling", {"model": "tiny-embed", "input": TEXTS[:2]})
    assert status == 200, body
    assert [d["object"] for d in body["data"]] == ["pooling", "pooling"]
    for data, expected in zip(body["data"], want):
        torch.testing.assert_close(torch.tensor(data["data"]), expected, atol=2e-5, rtol=1e-4)


def test_score_is_the_cosine_of_hf_embeddings(server, want) -> None:
    for path in ("/v1/score", "/score"):
        status, body = _post(server, path, {"model": "tiny-embed", "text_1": TEXTS[0], "text_2": TEXTS[1:]})
        assert status == 200, body
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        expected = [torch.dot(want[0], w).item() for w in want[1:]]
        assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)
    status, body = _post(server, "/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS[2:]})  # N -> N
    assert [d["score"] for d in body["data"]] == pytest.approx(
        [torch.dot(want[0], want[2]).item(), torch.dot(want[1], want[3]).item()], abs=1e-5
    )


def test_rerank_orders_documents_by_hf_cosine(server, want) -> None:
    expected = [torch.dot(want[0], w).item() for w in want[1:]]
    order = sorted(range(3), key=lambda i: expected[i], reverse=True)
    for path in ("/v1/rerank", "/rerank"):
        status, body = _post(server, path, {"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 2})
        assert status == 200, body
        assert [r["index"] for r in body["results"]] == order[:2]
        for result in body["results"]:
            assert result["document"]["text"] == TEXTS[1 + result["index"]]
            assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)
        assert body["usage"]["total_tokens"] > 0


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"input": "x", "temperature": 0.5}, "temperature"),
        ("/v1/embeddings", {"input": [[1, 2], "x"]}, "input"),
        ("/v1/embeddings", {"input": [10**9]}, "prompt"),
        ("/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS}, "text_1"),
        ("/v1/score", {"text_1": [], "text_2": "x"}, "text_1"),
        ("/v1/embeddings", {"input": [1] * 300}, "input"),  # over max_model_len (256)
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ],
)
def test_bad_fields_are_400_naming_them(server, path: str, body: dict, field: str) -> None:
    status, answer = _post(server, path, body)
    assert status == 400, answer
    assert field in answer["error"]["message"] or answer["error"].get("param") == field, answer


def test_generation_routes_are_refused_naming_the_route(server, client) -> None:
    with pytest.raises(openai.BadRequestError, match="/v1/chat/completions is not supported"):
        client.chat.completions.create(model="tiny-embed", messages=[{"role": "user", "content": "hi"}])
    for path in ("/v1/completions", "/v1/responses", "/v1/messages"):
        status, body = _post(server, path, {"model": "tiny-embed", "prompt": "hi"})
        assert status == 400 and f"{path} is not supported" in body["error"]["message"], body


def test_every_pooling_route_needs_the_api_key(server) -> None:
    for path in ("/v1/embeddings", "/pooling", "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank"):
        status, _ = _post(server, path, {"input": "x"}, authorize=False)
        assert status == 401, path


def test_a_generating_server_refuses_pooling_routes(surface_server) -> None:
    for path, body in (
        ("/v1/embeddings", {"input": "x"}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
    ):
        status, answer = _post(surface_server, path, body)
        assert status == 400 and "needs a pooling model" in answer["error"]["message"], answer
