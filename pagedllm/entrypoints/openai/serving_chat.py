"""POST /v1/chat/completions: messages through the model's chat template, ``n`` choices, tools."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import jinja2

from pagedllm.core.request import Logprob, SampleLogprobs
from pagedllm.entrypoints.openai.chat_output import ChatDelta, ChatOutputParser
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
    UsageInfo,
    sse_event,
)
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningParser
from pagedllm.entrypoints.openai.serving_engine import (
    MIN_LOGPROB,
    APIError,
    DisconnectGuard,
    EnginePrompt,
    OpenAIServing,
    clamp_logprob,
    new_request_id,
    prompt_logprobs_json,
    sse_error,
    top_logprobs,
    usage,
    usage_info,
)
from pagedllm.entrypoints.openai.tool_parsers import ToolParser
from pagedllm.entrypoints.openai.tools import (
    extract_tool_calls,
    parse_whole_output,
    tool_constraint,
    tool_mode,
)
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from starlette.requests import Request

    from pagedllm.engine.async_engine import RequestStream
    from pagedllm.tokenizer import Tokenizer

ASSISTANT = "assistant"
# Longest a chat template may take to render; it runs in a thread, so the event loop never waits.
RENDER_TIMEOUT_S = 10.0
# Keys apply_chat_template sets itself: chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
    }
)


@dataclasses.dataclass
class _ChoiceProgress:
    """What a streamed choice has sent so far, and what it holds back."""

    # Tokens generated so far (usage).
    num_tokens: int = 0
    finished: bool = False
    # With required or a named tool: the constrained JSON is held back until the choice ends,
    # with its tokens and their logprobs.
    holding: bool = False
    held_text: str = ""
    held_token_ids: list[int] = dataclasses.field(default_factory=list)
    held_logprobs: SampleLogprobs = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PreparedChat:
    """A chat request made ready for the engine."""

    # How tool calls are read: "none", "auto", "required" or "named" (tools.tool_mode).
    mode: str
    prompt: EnginePrompt
    params: SamplingParams
    # Makes each choice's ChatOutputParser; None when the text is all content.
    output_parsers: Callable[[], ChatOutputParser] | None
    # The adapter the request's ``model`` names (enable_lora), or None: the base model.
    lora_request: LoRARequest | None = None


class OpenAIServingChat(OpenAIServing):
    """Args (beyond OpenAIServing's):
    trust_request_chat_template: allow a request's own ``chat_template``; off, it is a 400.
    tool_parser: reads tool calls for ``tool_choice`` auto (made per request, with its tools);
        None turns auto off.
    reasoning_parser: separates the reasoning (``reasoning_content``); None: all text is content.
    """

    def __init__(
        self,
        *args: Any,
        trust_request_chat_template: bool = False,
        tool_parser: type[ToolParser] | None = None,
        reasoning_parser: type[ReasoningParser] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self._render_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chat-template")

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """The response, or (``stream``) its server-sent events. Raises APIError for a bad request."""
        arrival_time = time.time()
        prepared = await self.prepare(request)
        mode, params, output_parsers = prepared.mode, prepared.params, prepared.output_parsers
        request_id = "chatcmpl-" + new_request_id(raw_request)
        [stream], guard = await self.add_requests(
            request_id, [prepared.prompt], params, arrival_time, raw_request, bool(request.stream),
            prepared.lora_request,
        )  # fmt: skip
        if request.stream:
            return self._stream(request, mode, guard, request_id, stream, params.n, output_parsers)
        with guard:
            [final] = await self.collect([stream])
        return self._response(request, mode, request_id, final, output_parsers)

    async def prepare(self, request: ChatCompletionRequest) -> PreparedChat:
        """The checked request's prompt, sampling parameters and output parsing (also what
        /v1/responses and /v1/messages run, after turning their requests into chat requests)."""
        lora_request = self.check_model(request.model)
        self.check_request_options(request)
        self._check_logprobs(request)
        try:
            mode = tool_mode(request, self.tool_parser)
            constraint = tool_constraint(request, mode)
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice") from e
        token_ids = await self.render(request)
        if request.truncate_prompt_tokens is not None and request.truncate_prompt_tokens >= 1:
            token_ids = token_ids[-request.truncate_prompt_tokens :]
        prompt = EnginePrompt(token_ids)
        max_tokens = request.max_completion_tokens or request.max_tokens
        self.check_lengths(len(prompt.token_ids), max_tokens, "messages")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = await self.sampling_params(request, max_tokens, logprobs)
        if constraint is not None:
            if params.structured_outputs is not None:
                raise APIError(
                    400,
                    f"tool_choice {mode!r} and {request.structured_outputs_field} both constrain the output",
                    param="tool_choice",
                )
            params.structured_outputs = constraint
            await self.compile_structured_outputs(params, "tools")
        return PreparedChat(mode, prompt, params, self.output_parsers(request, mode, params), lora_request)

    def output_parsers(
        self, request: ChatCompletionRequest, mode: str, params: SamplingParams
    ) -> Callable[[], ChatOutputParser] | None:
        """What makes each choice's ChatOutputParser, or None when the text is all content (no
        reasoning parser, no auto tool calls). An output constrained to JSON (a schema, required
        or named tools) is read as it is: its grammar leaves no room for reasoning. A regex,
        choice or grammar shapes the whole text, a thinking section included if it has one."""
        tool_parser = None
        if mode == "auto" and self.tool_parser is not None:
            tool_parser = self.tool_parser([tool.model_dump(exclude_none=True) for tool in request.tools])
            if tool_parser.keeps_special_tokens:
                params.skip_special_tokens = False
        structured = params.structured_outputs
        json_output = structured is not None and (structured.json is not None or structured.json_object)
        reasoning = None if json_output else self.reasoning_parser
        if reasoning is not None and reasoning.keeps_special_tokens:
            params.skip_special_tokens = False
        if tool_parser is None and reasoning is None:
            return None
        return lambda: ChatOutputParser(reasoning() if reasoning is not None else None, tool_parser)

    @staticmethod
    def _check_logprobs(request: ChatCompletionRequest) -> None:
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_LOGPROBS:
            raise APIError(
                400,
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {request.top_logprobs}",
                param="top_logprobs",
            )

    # --- the prompt -------------------------------------------------------------------------

    async def render(self, request: ChatCompletionRequest, bounded: bool = True) -> list[int]:
        """The prompt's token ids: the messages rendered by the chat template in a worker thread
        (bounded in time), then tokenized in the tokenizing thread; ``bounded``: refused when the
        rendered text has more characters than the context can hold."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template: use /v1/completions")
        messages = [_message_dict(i, message) for i, message in enumerate(request.messages)]
        kwargs = self._template_kwargs(request)
        loop = asyncio.get_running_loop()
        try:
            text = await asyncio.wait_for(
                loop.run_in_executor(self._render_pool, lambda: _render_text(tokenizer, messages, kwargs)),
                RENDER_TIMEOUT_S,
            )
        except asyncio.TimeoutError as e:
            raise APIError(
                400, f"the chat template took over {RENDER_TIMEOUT_S:g} s", param="messages"
            ) from e
        except (ValueError, TypeError, KeyError, IndexError, jinja2.TemplateError) as e:
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
        return await self.encode(text, "messages", add_special_tokens=False, bounded=bounded)

    def _template_kwargs(self, request: ChatCompletionRequest) -> dict[str, Any]:
        extra = dict(request.chat_template_kwargs or {})
        clashing = sorted(_RESERVED_TEMPLATE_KWARGS & set(extra))
        if clashing:
            raise APIError(
                400, f"chat_template_kwargs may not set {', '.join(clashing)}", param="chat_template_kwargs"
            )
        template = extra.pop("chat_template", None) or request.chat_template
        if template is not None and not self.trust_request_chat_template:
            raise APIError(
                400,
                "this server does not render request-supplied chat templates (start it with "
                "--trust-request-chat-template to allow them)",
                param="chat_template",
            )
        if request.continue_final_message and request.add_generation_prompt:
            raise APIError(
                400,
                "continue_final_message needs add_generation_prompt set to false",
                param="continue_final_message",
            )
        kwargs = {
            **extra,
            "add_generation_prompt": bool(request.add_generation_prompt),
            "continue_final_message": bool(request.continue_final_message),
        }
        if template is not None:
            kwargs["chat_template"] = template
        if request.reasoning_effort is not None:
            if "reasoning_effort" not in self._template_source(template):
                raise APIError(
                    400,
                    "this model's chat template takes no reasoning_effort (chat_template_kwargs "
                    "passes the variables it does take, e.g. enable_thinking)",
                    param="reasoning_effort",
                )
            kwargs["reasoning_effort"] = request.reasoning_effort
        if request.tools and request.tool_choice != "none":
            kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in request.tools]
        return kwargs

    def _template_source(self, template: str | None) -> str:
        """The chat template's text (every named template's, for a tokenizer with several)."""
        source = template if template is not None else self.tokenizer.chat_template
        return " ".join(source.values()) if isinstance(source, dict) else source or ""

    # --- responses --------------------------------------------------------------------------

    def _response(
        self,
        request: ChatCompletionRequest,
        mode: str,
        request_id: str,
        final: RequestOutput,
        output_parsers: Callable[[], ChatOutputParser] | None,
    ) -> ChatCompletionResponse:
        choices = []
        for output in final.outputs:
            reasoning = None
            if output_parsers is not None:
                reasoning, content, tool_calls = parse_whole_output(output_parsers(), output.text)
            else:
                content, tool_calls = extract_tool_calls(request, mode, output.text)
            message = ChatMessage(
                role=ASSISTANT,
                content=_echo(request) + (content or ""),
                reasoning_content=reasoning,
                tool_calls=tool_calls,
            )
            if content is None and not _echo(request):
                message.content = None
            choices.append(
                ChatCompletionResponseChoice(
                    index=output.index,
                    message=message,
                    logprobs=self._logprobs(request, output.token_ids, output.logprobs),
                    finish_reason=_finish_reason(output.finish_reason, tool_calls),
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=usage_info([final]),
            prompt_logprobs=prompt_logprobs_json(self, final, request.return_tokens_as_token_ids),
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        mode: str,
        guard: DisconnectGuard,
        request_id: str,
        stream: RequestStream,
        n: int,
        output_parsers: Callable[[], ChatOutputParser] | None,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = request.include_usage_in_stream

        def chunk(choices: list[ChatCompletionResponseStreamChoice], usage: UsageInfo | None = None) -> str:
            response = ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
            )
            return sse_event(response, include_usage)

        progress: dict[int, _ChoiceProgress] = defaultdict(_ChoiceProgress)
        parsers: dict[int, ChatOutputParser | None] = defaultdict(output_parsers or (lambda: None))
        num_prompt_tokens = 0

        def usage_so_far() -> UsageInfo:
            return usage(num_prompt_tokens, sum(choice.num_tokens for choice in progress.values()))

        with guard:
            try:
                # OpenAI opens each choice with the role and empty content (vLLM's echo: the
                # final assistant message's text).
                for index in range(n):
                    role = DeltaMessage(role=ASSISTANT, content=_echo(request))
                    yield chunk([ChatCompletionResponseStreamChoice(index=index, delta=role)])
                # Each output holds what is new since the last (DELTA), for the choices with news.
                async for output in stream:
                    num_prompt_tokens = len(output.prompt_token_ids)
                    choices = []
                    for completion in output.outputs:
                        choice = self._stream_choice(
                            request, mode, completion, progress[completion.index], parsers[completion.index]
                        )
                        if choice is not None:
                            choices.append(choice)
                    if choices:
                        yield chunk(choices, usage_so_far() if request.continuous_usage else None)
            except Exception as e:
                yield sse_error(e)
                yield SSE_DONE
                return
        if include_usage and num_prompt_tokens:
            yield chunk([], usage_so_far())
        yield SSE_DONE

    def _stream_choice(
        self,
        request: ChatCompletionRequest,
        mode: str,
        completion: CompletionOutput,
        progress: _ChoiceProgress,
        output_parser: ChatOutputParser | None,
    ) -> ChatCompletionResponseStreamChoice | None:
        """The choice's chunk for ``completion``, what it gained since its last output, or None
        when there is nothing to send.

        ``output_parser`` splits reasoning and streams auto tool calls as they are written; with
        ``required`` or a named tool the whole output is held back, and its calls go out whole
        when the choice ends, one delta each (clients join a call's deltas by index).
        """
        if progress.finished:
            return None
        finish_reason = completion.finish_reason
        progress.num_tokens += len(completion.token_ids)
        if mode in ("required", "named"):
            progress.holding = True
        tool_calls: list[ToolCall] = []
        parsed = ChatDelta()
        token_ids, token_logprobs = completion.token_ids, completion.logprobs or []
        if progress.holding:
            progress.held_text += completion.text
            progress.held_token_ids += token_ids
            progress.held_logprobs += token_logprobs
            if finish_reason is None:
                return None
            content, tool_calls = extract_tool_calls(request, mode, progress.held_text)
            delta_text = content or ""
            token_ids, token_logprobs = progress.held_token_ids, progress.held_logprobs
        elif output_parser is not None:
            parsed = output_parser.feed(completion.text, finish_reason is not None)
            delta_text = parsed.content
        else:
            delta_text = completion.text
        logprobs = None
        if request.logprobs and token_ids:
            logprobs = self._logprobs(request, token_ids, token_logprobs)
        if not (delta_text or logprobs or finish_reason or tool_calls or parsed):
            return None
        progress.finished = finish_reason is not None
        delta = DeltaMessage(
            content=delta_text if delta_text or logprobs else None, reasoning_content=parsed.reasoning or None
        )
        if tool_calls:
            delta.tool_calls = [
                DeltaToolCall(
                    index=i,
                    id=call.id,
                    type="function",
                    function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
                )
                for i, call in enumerate(tool_calls)
            ]
        elif parsed.tool_calls:
            delta.tool_calls = [
                DeltaToolCall(
                    index=call.index,
                    id=call.id,
                    type="function" if call.id else None,
                    function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
                )
                for call in parsed.tool_calls
            ]
        called = bool(tool_calls) or (output_parser is not None and output_parser.called)
        return ChatCompletionResponseStreamChoice(
            index=completion.index,
            # The closing chunk of a choice has an empty delta unless text came with it.
            delta=delta,
            logprobs=logprobs,
            finish_reason="tool_calls" if called and finish_reason == "stop" else finish_reason,
        )

    def _logprobs(
        self, request: ChatCompletionRequest, token_ids: list[int], logprobs: SampleLogprobs | None
    ) -> ChatCompletionLogProbs | None:
        if not request.logprobs:
            return None
        as_ids = bool(request.return_tokens_as_token_ids)
        content = []
        for token_id, step in zip(token_ids, logprobs or []):
            chosen = self._entry(token_id, step.get(token_id), as_ids)
            top = [self._entry(i, lp, as_ids) for i, lp in top_logprobs(step, request.top_logprobs or 0)]
            content.append(ChatCompletionLogProbsContent(**chosen.model_dump(), top_logprobs=top))
        return ChatCompletionLogProbs(content=content)

    def _entry(self, token_id: int, logprob: Logprob | None, as_token_id: bool) -> ChatCompletionLogProb:
        token = self.decode_token(token_id, logprob, as_token_id)
        return ChatCompletionLogProb(
            token=token,
            logprob=MIN_LOGPROB if logprob is None else clamp_logprob(logprob.logprob),
            bytes=list(token.encode(errors="replace")),
        )


def _render_text(tokenizer: Tokenizer, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    if kwargs.get("chat_template") is None and tokenizer.chat_template is None:
        raise ValueError("this model's tokenizer has no chat template: use /v1/completions")
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def _echo(request: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the final assistant message's text, which the output continues."""
    last = request.messages[-1]
    if not request.echo or last.role != ASSISTANT or not isinstance(last.content, str):
        return ""
    return last.content


def _finish_reason(finish_reason: str | None, tool_calls: list[ToolCall]) -> str | None:
    return "tool_calls" if tool_calls and finish_reason == "stop" else finish_reason


def _message_dict(index: int, message: ChatMessageParam) -> dict[str, Any]:
    """A message as chat templates take it: content parts joined into one string, tool calls'
    arguments as objects (templates write them with ``tojson``)."""
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
    result: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        result["name"] = message.name
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        result["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(index, call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    return result


def _arguments(index: int, arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError as e:
        raise APIError(
            400, f"tool call arguments must be JSON: {e}", param=f"messages[{index}].tool_calls"
        ) from None
