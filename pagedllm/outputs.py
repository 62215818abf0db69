"""What a request returns, step by step or at the end (vLLM's RequestOutput / CompletionOutput,
and for pooling models PoolingRequestOutput, EmbeddingRequestOutput, ScoringRequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from pagedllm.core.request import PromptLogprobs, RequestMetrics, SampleLogprobs

_O = TypeVar("_O")


@dataclass
class CompletionOutput:
    """One output sequence of a request.

    Args:
        index: the sequence's index among the request's outputs.
        text: the generated text so far (without a matched stop string).
        token_ids: the generated token ids.
        cumulative_logprob: sum of the generated tokens' logprobs.
        logprobs: per generated token, the chosen and top-k tokens' logprobs (when asked for).
        finish_reason: None while running; "stop" (EOS, stop string or stop token), "length"
            (max_tokens or the context limit), "abort", or "error" (the engine failed the
            request: see ``RequestOutput.error``).
        stop_reason: the stop string or stop token id that ended it, None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step: the prompt and each output sequence.

    ``error`` says why a request finished without running to its end: its prompt is longer than
    the model's context (one empty output with ``finish_reason="length"``), or the engine failed
    it because a model step raised whenever it ran (``failed``: the sequences it was running end
    with ``finish_reason="error"`` and keep their tokens so far; with best_of > n every sequence
    is returned, unranked).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None

    @property
    def failed(self) -> bool:
        """Whether the engine failed the request (see ``error``)."""
        return any(output.finish_reason == "error" for output in self.outputs)


# --- pooling models (runner="pooling"; vLLM's PoolingRequestOutput and its task views) ---------


@dataclass
class PoolingOutput:
    """A pooling model's vector for one prompt: data [hidden_size or dimensions] float32."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput(Generic[_O]):
    """A pooling request's result: one output (no sequences, no text)."""

    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    finished: bool
    metrics: RequestMetrics | None = None
    # Why it ended without a vector (the engine failed it: a model step raised whenever it ran).
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass
class EmbeddingOutput:
    """An embedding as a list of floats (``LLM.embed``)."""

    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> EmbeddingOutput:
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @classmethod
    def from_base(cls, request_output: PoolingRequestOutput[PoolingOutput]) -> EmbeddingRequestOutput:
        return cls(
            request_output.request_id,
            EmbeddingOutput.from_base(request_output.outputs),
            request_output.prompt_token_ids,
            request_output.finished,
            request_output.metrics,
            request_output.error,
        )


@dataclass
class ScoringOutput:
    """The similarity of a text pair (``LLM.score``): the cosine of their embeddings."""

    score: float


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    pass
