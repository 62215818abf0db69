"""POST /v1/completions: one engine request per prompt, ``n`` choices each, streamed or not."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from pagedllm.core.request import Logprob, PromptLogprobs
from pagedllm.entrypoints.openai.protocol import (
    SSE_DONE,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
    sse_event,
)
from pagedllm.entrypoints.openai.serving_engine import (
    APIError,
    DisconnectGuard,
    EnginePrompt,
    OpenAIServing,
    clamp_logprob,
    merge_streams,
    new_request_id,
    prompt_logprobs_json,
    sse_error,
    top_logprobs,
    usage,
    usage_info,
)
from pagedllm.outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from starlette.requests import Request

    from pagedllm.engine.async_engine import RequestStream


@dataclasses.dataclass
class _ChoiceProgress:
    """What a choice has sent so far, and the echoed prompt its first chunk still has to send."""

    # Of the completion: tokens sent.
    num_tokens: int = 0
    # Of the whole text (echo included): where the next chunk's text starts.
    text_offset: int = 0
    finished: bool = False
    echo: str = ""
    # With logprobs: the echoed prompt's token ids and their logprobs (None for the first).
    echo_token_ids: list[int] = dataclasses.field(default_factory=list)
    echo_logprobs: PromptLogprobs = dataclasses.field(default_factory=list)


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self, request: CompletionRequest, raw_request: Request
    ) -> CompletionResponse | AsyncIterator[str]:
        """The response, or (``stream``) its server-sent events. Raises APIError for a bad request."""
        arrival_time = time.time()
        lora_request = self.check_model(request.model)
        self.check_request_options(request)
        if request.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = await self._engine_prompts(request.prompt)
        if request.truncate_prompt_tokens is not None and request.truncate_prompt_tokens >= 1:
            # Cut here, so the length check sees what the engine will run.
            keep = request.truncate_prompt_tokens
            prompts = [EnginePrompt(p.token_ids[-keep:]) if len(p.token_ids) > keep else p for p in prompts]
        for prompt in prompts:
            self.check_lengths(len(prompt.token_ids), request.max_tokens, "prompt")
        # Echoed prompts come with their own logprobs, as OpenAI's do.
        prompt_logprobs = request.logprobs if request.echo else None
        params = await self.sampling_params(request, request.max_tokens, request.logprobs, prompt_logprobs)
        request_id = "cmpl-" + new_request_id(raw_request)
        streams, guard = await self.add_requests(
            request_id, prompts, params, arrival_time, raw_request, bool(request.stream), lora_request
        )
        if request.stream:
            return self._stream(request, guard, request_id, prompts, streams)
        with guard:
            finals = await self.collect(streams)
        return self._response(request, request_id, prompts, finals)

    async def _engine_prompts(
        self, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> list[EnginePrompt]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        prompts = []
        for item in prompt:
            if isinstance(item, str):
                prompts.append(EnginePrompt(await self.encode(item, "prompt"), item))
            elif not item:
                raise APIError(400, "prompt must not be empty", param="prompt")
            else:
                prompts.append(EnginePrompt(list(item)))
        return prompts

    def _progress(
        self, request: CompletionRequest, prompt: EnginePrompt, output: RequestOutput
    ) -> _ChoiceProgress:
        """A choice's progress before its first chunk."""
        progress = _ChoiceProgress()
        if not request.echo:
            return progress
        if prompt.text is not None:
            progress.echo = prompt.text
        elif self.tokenizer is not None:
            progress.echo = self.tokenizer.decode(prompt.token_ids)
        if request.logprobs is not None:
            progress.echo_token_ids = output.prompt_token_ids
            progress.echo_logprobs = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        return progress

    def _response(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[EnginePrompt],
        finals: list[RequestOutput],
    ) -> CompletionResponse:
        n = len(finals[0].outputs)
        choices = []
        for prompt_index, (prompt, final) in enumerate(zip(prompts, finals)):
            for output in final.outputs:
                # A whole choice is the one chunk its final output makes when nothing was sent.
                progress = self._progress(request, prompt, final)
                choice = self._choice_delta(request, prompt_index * n + output.index, output, progress)
                assert choice is not None
                if request.prompt_logprobs is not None:
                    choice.prompt_logprobs = prompt_logprobs_json(
                        self, final, bool(request.return_tokens_as_token_ids)
                    )
                choices.append(choice)
        return CompletionResponse(
            id=request_id, model=self.model_name, choices=choices, usage=usage_info(finals)
        )

    async def _stream(
        self,
        request: CompletionRequest,
        guard: DisconnectGuard,
        request_id: str,
        prompts: list[EnginePrompt],
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = request.include_usage_in_stream
        progress: dict[tuple[int, int], _ChoiceProgress] = {}
        n = request.n or 1
        with guard:
            try:
                # Each output holds what is new since the prompt's last one (DELTA), and only
                # the choices that have news.
                async for prompt_index, output in merge_streams(streams):
                    choices = []
                    for completion in output.outputs:
                        key = (prompt_index, completion.index)
                        if key not in progress:
                            progress[key] = self._progress(request, prompts[prompt_index], output)
                        choice = self._choice_delta(
                            request, prompt_index * n + completion.index, completion, progress[key]
                        )
                        if choice is not None:
                            choices.append(choice)
                    if choices:
                        chunk = CompletionStreamResponse(
                            id=request_id,
                            created=created,
                            model=self.model_name,
                            choices=choices,
                            usage=_usage(prompts, progress, prompt_index)
                            if request.continuous_usage
                            else None,
                        )
                        yield sse_event(chunk, include_usage)
            except Exception as e:
                yield sse_error(e)
                yield SSE_DONE
                return
        if include_usage:
            chunk = CompletionStreamResponse(
                id=request_id,
                created=created,
                model=self.model_name,
                choices=[],
                usage=_usage(prompts, progress),
            )
            yield sse_event(chunk, include_usage)
        yield SSE_DONE

    def _choice_delta(
        self, request: CompletionRequest, index: int, completion: CompletionOutput, progress: _ChoiceProgress
    ) -> CompletionResponseChoice | None:
        """The choice's chunk for ``completion``, what it gained since its last chunk (advancing
        ``progress``), or None when that is nothing."""
        if progress.finished:
            return None
        delta_text = completion.text
        new_token_ids = completion.token_ids
        # A chunk per new token, even when it adds no text yet (a partial character, a held-back
        # stop string prefix, a model without a tokenizer): clients time tokens by chunks.
        if not (progress.echo or delta_text or new_token_ids or completion.finish_reason):
            return None
        logprobs = None
        if request.logprobs is not None:
            logprobs = self._logprobs(
                progress.echo_token_ids + new_token_ids,
                progress.echo_logprobs + (completion.logprobs or []),
                request.logprobs,
                progress.text_offset,
                bool(request.return_tokens_as_token_ids),
            )
        text = progress.echo + delta_text
        progress.echo, progress.echo_token_ids, progress.echo_logprobs = "", [], []
        progress.num_tokens += len(new_token_ids)
        progress.text_offset += len(text)
        progress.finished = completion.finish_reason is not None
        return CompletionResponseChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=completion.finish_reason
        )

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: list[dict[int, Logprob] | None],
        num_top: int,
        text_offset: int,
        as_token_ids: bool,
    ) -> CompletionLogProbs:
        """OpenAI's completion logprobs of ``token_ids``, whose text starts at ``text_offset``; a
        position without logprobs (a prompt's first token) has None."""
        result = CompletionLogProbs()
        for token_id, step in zip(token_ids, logprobs):
            chosen = None if step is None else step.get(token_id)
            token = self.decode_token(token_id, chosen, as_token_ids)
            result.tokens.append(token)
            result.token_logprobs.append(None if chosen is None else clamp_logprob(chosen.logprob))
            top = top_logprobs(step, num_top) if step is not None and num_top else None
            if top is not None and chosen is not None and all(i != token_id for i, _ in top):
                # vLLM's completions list the sampled token too, even outside the top ones.
                top.append((token_id, chosen))
            result.top_logprobs.append(
                None
                if top is None
                else {self.decode_token(i, lp, as_token_ids): clamp_logprob(lp.logprob) for i, lp in top}
            )
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result


def _usage(
    prompts: list[EnginePrompt],
    progress: dict[tuple[int, int], _ChoiceProgress],
    prompt_index: int | None = None,
) -> UsageInfo:
    """Token counts of the prompts' choices so far (of one prompt's, given ``prompt_index``)."""
    indices = range(len(prompts)) if prompt_index is None else [prompt_index]
    prompt_tokens = sum(len(prompts[i].token_ids) for i in indices)
    completion_tokens = sum(p.num_tokens for (i, _), p in progress.items() if i in indices)
    return usage(prompt_tokens, completion_tokens)
