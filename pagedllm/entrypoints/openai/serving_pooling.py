"""The pooling routes: ``/v1/embeddings`` (OpenAI's), ``/pooling``, ``/v1/score`` and ``/v1/rerank``
(vLLM's; score and rerank for embedding models: the cosine of two embeddings).

A server runs one kind of model. A ``--runner pooling`` server answers these and refuses the
generation routes with a 400 naming the route; a generating server refuses these the same way,
so a client pointed at the wrong server learns why at once.

Every input becomes one engine request (``PoolingParams``); the engine computes the prompts in
its usual steps, prefill only, and each request ends with its embedding. Score and rerank embed
each distinct text once and compare the embeddings here.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import TYPE_CHECKING

import torch

from pagedllm.engine.pooling_output import resolve_pooling_params
from pagedllm.entrypoints.openai.protocol import UsageInfo
from pagedllm.entrypoints.openai.protocol_pooling import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    PoolingInput,
    PoolingResponse,
    PoolingResponseData,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from pagedllm.entrypoints.openai.serving_engine import (
    APIError,
    EnginePrompt,
    OpenAIServing,
    log_advisory_fields,
    new_request_id,
    usage,
)
from pagedllm.entrypoints.score_utils import cosine_similarity, pair_inputs
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.requests import Request

# What a pooling server does not serve: every route that generates.
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


def refuse_generation_routes(app: FastAPI) -> None:
    """On a pooling server: a 400 naming the route for each generation route (added before them,
    so they never run)."""
    for path in GENERATION_ROUTES:

        async def refuse(path: str = path) -> None:
            raise APIError(
                400,
                f"{path} is not supported by this server: it runs a pooling model (--runner pooling), "
                "which returns embeddings (/v1/embeddings, /v1/score, /v1/rerank), not generated text",
                code="model_not_supported",
            )

        app.post(path, include_in_schema=False)(refuse)


class OpenAIServingPooling(OpenAIServing):
    """Embeddings, scores and reranking over the engine's pooling requests."""

    def _check_pooling(self, route: str) -> None:
        if self.engine.config.pooler_config is None:
            raise APIError(
                400,
                f"{route} needs a pooling model, and this server runs a generating one: start it "
                "with `pagedllm serve MODEL --runner pooling`",
                code="model_not_supported",
            )

    def _pooling_params(self, dimensions: int | None = None, normalize: bool | None = None) -> PoolingParams:
        """The request's PoolingParams, checked against the model: a 400 naming the field."""
        try:
            params = resolve_pooling_params(PoolingParams(dimensions, normalize), self.engine.config)
        except ValueError as e:
            message = str(e)
            raise APIError(
                400, message, param="dimensions" if "dimensions" in message else "normalize"
            ) from e
        assert params is not None
        return params

    async def _prompts(
        self, inputs: PoolingInput, param: str, add_special_tokens: bool = True
    ) -> list[EnginePrompt]:
        """One engine prompt per input (a string, token ids, or a list of either); 400s name
        ``param``."""
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]  # type: ignore[list-item]
        if not inputs:
            raise APIError(400, f"{param} must not be empty", param=param)
        prompts = []
        for item in inputs:
            if isinstance(item, str):
                prompts.append(EnginePrompt(await self.encode(item, param, add_special_tokens), item))
            else:
                prompts.append(EnginePrompt(list(item)))
            self.check_lengths(len(prompts[-1].token_ids), None, param)
        return prompts

    async def _embed(
        self,
        prompts: list[EnginePrompt],
        params: PoolingParams,
        raw_request: Request,
        lora_request: LoRARequest | None,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's finished output, in order."""
        streams, guard = await self.add_requests(
            new_request_id(raw_request), prompts, params, time.time(), raw_request, False, lora_request
        )
        with guard:
            return await self.collect(streams)  # type: ignore[return-value]

    # --- the routes -------------------------------------------------------------------------

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> EmbeddingResponse:
        vectors, used = await self._embed_request(request, raw_request, "/v1/embeddings")
        data = [EmbeddingResponseData(index=i, embedding=vector) for i, vector in enumerate(vectors)]
        model = request.model or self.model_name
        return EmbeddingResponse(id=f"embd-{uuid.uuid4().hex}", model=model, data=data, usage=used)

    async def create_pooling(self, request: EmbeddingRequest, raw_request: Request) -> PoolingResponse:
        """vLLM's /pooling: an embedding request's body, the vectors as ``data[i].data``."""
        vectors, used = await self._embed_request(request, raw_request, "/pooling")
        data = [PoolingResponseData(index=i, data=vector) for i, vector in enumerate(vectors)]
        model = request.model or self.model_name
        return PoolingResponse(id=f"pool-{uuid.uuid4().hex}", model=model, data=data, usage=used)

    async def _embed_request(
        self, request: EmbeddingRequest, raw_request: Request, route: str
    ) -> tuple[list[list[float] | str], UsageInfo]:
        """The request's vectors, in input order and its ``encoding_format``, and its usage."""
        self._check_pooling(route)
        log_advisory_fields(request)
        lora_request = self.check_model(request.model)
        params = self._pooling_params(request.dimensions, request.normalize)
        prompts = await self._prompts(request.input, "input", request.add_special_tokens)
        finals = await self._embed(prompts, params, raw_request, lora_request)
        vectors = [_encode(final.outputs.data, request.encoding_format) for final in finals]
        return vectors, usage(sum(len(final.prompt_token_ids) for final in finals), 0)

    async def create_score(self, request: ScoreRequest, raw_request: Request) -> ScoreResponse:
        self._check_pooling("/v1/score")
        lora_request = self.check_model(request.model)
        try:
            pairs = pair_inputs(request.text_1, request.text_2, str)
        except ValueError as e:
            raise APIError(400, str(e), param="text_1") from e
        scores, num_tokens = await self._score_pairs(pairs, raw_request, lora_request, "text_1")
        data = [ScoreResponseData(index=i, score=score) for i, score in enumerate(scores)]
        return ScoreResponse(
            id=f"score-{uuid.uuid4().hex}",
            model=request.model or self.model_name,
            data=data,
            usage=usage(num_tokens, 0),
        )

    async def create_rerank(self, request: RerankRequest, raw_request: Request) -> RerankResponse:
        self._check_pooling("/v1/rerank")
        lora_request = self.check_model(request.model)
        if not request.documents:
            raise APIError(400, "documents must not be empty", param="documents")
        if request.top_n < 0:
            raise APIError(400, f"top_n must be >= 0 (0: every document), got {request.top_n}", param="top_n")
        pairs = [(request.query, document) for document in request.documents]
        scores, num_tokens = await self._score_pairs(pairs, raw_request, lora_request, "documents")
        ranked = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        if request.top_n:
            ranked = ranked[: request.top_n]
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=request.documents[i]) if request.return_documents else None,
                relevance_score=scores[i],
            )
            for i in ranked
        ]
        return RerankResponse(
            id=f"rerank-{uuid.uuid4().hex}",
            model=request.model or self.model_name,
            usage=RerankUsage(total_tokens=num_tokens),
            results=results,
        )

    async def _score_pairs(
        self,
        pairs: list[tuple[str, str]],
        raw_request: Request,
        lora_request: LoRARequest | None,
        param: str,
    ) -> tuple[list[float], int]:
        """The cosine of each pair's embeddings (each distinct text embedded once), and the tokens
        of the pairs (as vLLM counts them: both texts of each pair)."""
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        prompts = await self._prompts(texts, param)
        finals = await self._embed(prompts, self._pooling_params(), raw_request, lora_request)
        by_text = {text: final for text, final in zip(texts, finals)}
        scores = [
            cosine_similarity(by_text[a].outputs.data.tolist(), by_text[b].outputs.data.tolist())
            for a, b in pairs
        ]
        num_tokens = sum(
            len(by_text[a].prompt_token_ids) + len(by_text[b].prompt_token_ids) for a, b in pairs
        )
        return scores, num_tokens


def _encode(embedding: torch.Tensor, encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: a list of floats, or base64 of the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(embedding.numpy().astype("<f4").tobytes()).decode("ascii")
    return embedding.tolist()
