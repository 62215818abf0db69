"""POST /v1/chat/completions: messages through the model's chat template, ``n`` choices."""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import jinja2

from pagedllm.core.request import Logprob, SampleLogprobs
from pagedllm.entrypoints.openai.protocol import (
    SSE_DONE,
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatMessageParam,
    DeltaMessage,
    UsageInfo,
    sse_event,
)
from pagedllm.entrypoints.openai.serving_engine import (
    MIN_LOGPROB,
    APIError,
    DisconnectGuard,
    EnginePrompt,
    OpenAIServing,
    clamp_logprob,
    new_request_id,
    sse_error,
    top_logprobs,
    usage_info,
)
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import MAX_LOGPROBS
from pagedllm.tokenizer import apply_chat_template

if TYPE_CHECKING:
    from starlette.requests import Request

    from pagedllm.engine.async_engine import RequestStream

ASSISTANT = "assistant"


@dataclasses.dataclass
class _ChoiceProgress:
    """What a streamed choice has sent so far."""

    num_chars: int = 0
    num_tokens: int = 0
    finished: bool = False


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """The response, or (``stream``) its server-sent events. Raises APIError for a bad request."""
        arrival_time = time.time()
        self.check_model(request.model)
        self.check_request_options(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_LOGPROBS:
            raise APIError(
                400,
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {request.top_logprobs}",
                param="top_logprobs",
            )
        prompt = EnginePrompt(self._render(request))
        max_tokens = request.max_completion_tokens or request.max_tokens
        self.check_lengths(len(prompt.token_ids), max_tokens, "messages")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, logprobs)
        request_id = "chatcmpl-" + new_request_id(raw_request)
        [stream] = await self.add_requests(request_id, [prompt], params, arrival_time)
        guard = self.abort_on_disconnect(raw_request, [stream])
        if request.stream:
            return self._stream(request, guard, request_id, stream, params.n)
        with guard:
            [final] = await self.collect([stream])
        return self._response(request, request_id, final)

    def _render(self, request: ChatCompletionRequest) -> list[int]:
        """The prompt's token ids: the messages rendered by the model's chat template."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template: use /v1/completions")
        messages = [_message_dict(i, message) for i, message in enumerate(request.messages)]
        try:
            return apply_chat_template(
                self.tokenizer,
                messages,
                bool(request.add_generation_prompt),
                **(request.chat_template_kwargs or {}),
            )
        except (ValueError, jinja2.TemplateError) as e:
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e

    def _response(
        self, request: ChatCompletionRequest, request_id: str, final: RequestOutput
    ) -> ChatCompletionResponse:
        choices = [
            ChatCompletionResponseChoice(
                index=output.index,
                message=ChatMessage(role=ASSISTANT, content=output.text),
                logprobs=self._logprobs(request, output.token_ids, output.logprobs),
                finish_reason=output.finish_reason,
            )
            for output in final.outputs
        ]
        return ChatCompletionResponse(
            id=request_id, model=self.model_name, choices=choices, usage=usage_info([final])
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        guard: DisconnectGuard,
        request_id: str,
        stream: RequestStream,
        n: int,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = request.include_usage_in_stream

        def chunk(choices: list[ChatCompletionResponseStreamChoice], usage: UsageInfo | None = None) -> str:
            response = ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
            )
            return sse_event(response, include_usage)

        progress: dict[int, _ChoiceProgress] = defaultdict(_ChoiceProgress)
        final = None
        with guard:
            try:
                # OpenAI opens each choice with the role and empty content.
                for index in range(n):
                    role = DeltaMessage(role=ASSISTANT, content="")
                    yield chunk([ChatCompletionResponseStreamChoice(index=index, delta=role)])
                async for output in stream:
                    choices = []
                    for completion in output.outputs:
                        choice = self._stream_choice(request, completion, progress[completion.index])
                        if choice is not None:
                            choices.append(choice)
                    if choices:
                        yield chunk(choices)
                    final = output
            except Exception as e:
                yield sse_error(e)
                yield SSE_DONE
                return
        if include_usage and final is not None:
            yield chunk([], usage_info([final]))
        yield SSE_DONE

    def _stream_choice(
        self, request: ChatCompletionRequest, completion: CompletionOutput, progress: _ChoiceProgress
    ) -> ChatCompletionResponseStreamChoice | None:
        """The choice's new content since its last chunk, or None when there is nothing to send."""
        if progress.finished:
            return None
        delta_text = completion.text[progress.num_chars :]
        new_token_ids = completion.token_ids[progress.num_tokens :]
        logprobs = None
        if request.logprobs and new_token_ids:
            logprobs = self._logprobs(
                request, new_token_ids, (completion.logprobs or [])[progress.num_tokens :]
            )
        if not (delta_text or logprobs or completion.finish_reason):
            return None
        progress.num_chars, progress.num_tokens = len(completion.text), len(completion.token_ids)
        progress.finished = completion.finish_reason is not None
        return ChatCompletionResponseStreamChoice(
            index=completion.index,
            # The closing chunk of a choice has an empty delta unless text came with it.
            delta=DeltaMessage(content=delta_text if delta_text or logprobs else None),
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
        )

    def _logprobs(
        self, request: ChatCompletionRequest, token_ids: list[int], logprobs: SampleLogprobs | None
    ) -> ChatCompletionLogProbs | None:
        if not request.logprobs:
            return None
        content = []
        for token_id, step in zip(token_ids, logprobs or []):
            chosen = self._entry(token_id, step.get(token_id))
            top = [self._entry(i, lp) for i, lp in top_logprobs(step, request.top_logprobs or 0)]
            content.append(ChatCompletionLogProbsContent(**chosen.model_dump(), top_logprobs=top))
        return ChatCompletionLogProbs(content=content)

    def _entry(self, token_id: int, logprob: Logprob | None) -> ChatCompletionLogProb:
        token = self.decode_token(token_id, logprob)
        return ChatCompletionLogProb(
            token=token,
            logprob=MIN_LOGPROB if logprob is None else clamp_logprob(logprob.logprob),
            bytes=list(token.encode()),
        )


def _message_dict(index: int, message: ChatMessageParam) -> dict[str, str]:
    """A message as chat templates take it: content parts joined into one string."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    400, "only text content parts are supported", param=f"messages[{index}].content"
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    result = {"role": message.role, "content": content or ""}
    if message.name is not None:
        result["name"] = message.name
    return result
