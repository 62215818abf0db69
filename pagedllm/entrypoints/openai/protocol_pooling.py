"""Bodies of the pooling routes (a ``--runner pooling`` server): OpenAI's ``/v1/embeddings``, and
vLLM's ``/v1/score`` and ``/v1/rerank`` (the Jina/Cohere rerank shape), with vLLM's field names."""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel, ResponseHeader, TopLevelRequest, UsageInfo

# One input: a string or a list of token ids; or several: a list of either.
PoolingInput = str | list[str] | list[int] | list[list[int]]
DataT = TypeVar("DataT")


class ListResponse(ResponseHeader, Generic[DataT]):
    """OpenAI's list object, the answer of /v1/embeddings, /pooling and /v1/score: one item per
    input (or pair), in input order."""

    object: Literal["list"] = "list"
    data: list[DataT]
    usage: UsageInfo


class EmbeddingRequest(TopLevelRequest):
    model: str | None = None
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka truncation: only for models whose config allows it (else a 400 naming it).
    dimensions: int | None = None
    # OpenAI's: an end-user id, advisory.
    user: str | None = None
    # vLLM's extras.
    add_special_tokens: bool = True
    normalize: bool | None = None


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    # Floats, or base64 of their little-endian float32 bytes (encoding_format="base64").
    embedding: list[float] | str


class EmbeddingResponse(ListResponse[EmbeddingResponseData]):
    pass


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(ListResponse[PoolingResponseData]):
    """vLLM's /pooling answer: the pooled vectors, whatever the model's task (here: embeddings)."""


class ScoreRequest(TopLevelRequest):
    model: str | None = None
    # One text_1 against each text_2 (1 -> N), or the lists one for one (N -> N).
    text_1: str | list[str]
    text_2: str | list[str]


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ListResponse[ScoreResponseData]):
    pass


class RerankRequest(TopLevelRequest):
    model: str | None = None
    query: str
    documents: list[str]
    # The best this many documents (0: all of them).
    top_n: int = 0
    # Cohere's: echo each document's text in its result (vLLM always does).
    return_documents: bool = True


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
