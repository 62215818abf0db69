"""What the completion and chat endpoints share: errors, model and length checks, sampling
parameters, handing requests to the engine, and aborting them when the client goes away."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pagedllm.core.request import Logprob
from pagedllm.engine.async_engine import AsyncEngineDeadError, AsyncLLMEngine, RequestStream
from pagedllm.entrypoints.openai.protocol import (
    ADVISORY_FIELDS,
    ErrorInfo,
    ErrorResponse,
    SamplingRequest,
    UsageInfo,
)
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from starlette.requests import Request

    from pagedllm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

REQUEST_ID_HEADER = "X-Request-Id"
# JSON has no -inf: the floor vLLM and OpenAI report for impossible tokens.
MIN_LOGPROB = -9999.0
# Longest wait for a request's grammar to compile before the request is refused.
COMPILE_TIMEOUT_S = 30.0
# Engine request ids are internal and unique: a counter ahead of whatever the client sent, so
# two requests with the same X-Request-Id never clash.
_engine_request_counter = itertools.count()
# Advisory fields already logged: each is logged once per process, not once per request.
_logged_advisory_fields: set[str] = set()


class APIError(Exception):
    """An error answered as OpenAI answers it: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(
            message=message,
            type=error_type or ("invalid_request_error" if status_code < 500 else "server_error"),
            param=param,
            code=code,
        )

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=self.info)


@dataclasses.dataclass
class EnginePrompt:
    """One prompt as the engine takes it."""

    token_ids: list[int]
    text: str | None = None


def clamp_logprob(logprob: float) -> float:
    return MIN_LOGPROB if math.isnan(logprob) else max(logprob, MIN_LOGPROB)


def top_logprobs(step: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The ``num_top`` most likely (token id, Logprob) of one position, most likely first."""
    return sorted(step.items(), key=lambda item: item[1].logprob, reverse=True)[:num_top]


class ServedModels(Protocol):
    """What the handlers ask of the served models (``serving_models.OpenAIServingModels``)."""

    def lora_request(self, model: str | None) -> LoRARequest | None: ...


class OpenAIServing:
    """Base of the endpoint handlers.

    Args:
        engine: the running engine.
        model_name: the name clients must give as ``model`` (or omit).
        tokenizer: the server's own (``AsyncLLMEngine.tokenizer``: the engine detokenizes with
            another, and a tokenizer is not shared between threads). None for token-id-only models.
    """

    def __init__(self, engine: AsyncLLMEngine, model_name: str, tokenizer: Tokenizer | None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = tokenizer
        # The served models (the base and its LoRA adapters), shared by the handlers; set by the
        # app. None: the base model alone.
        self.models: ServedModels | None = None
        self.max_model_len = engine.config.model_config.max_model_len
        # None with attention sinks: the completion may run past max_model_len.
        self.max_context_len = engine.config.model_config.max_context_len
        # Prompts are encoded and decoded in a thread of their own, with a copy of the tokenizer
        # of its own (a tokenizer is not shared between threads): a 1 MiB prompt takes about a
        # second, and on the event loop it would stall every stream and /health for as long. The
        # fast tokenizers release the GIL while they work. One thread: requests queue for it.
        self._encoder = copy.deepcopy(tokenizer)
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        # No token is longer than the vocabulary's longest, so a prompt of more characters than
        # max_model_len of them cannot fit: it is refused before it is tokenized.
        longest_token = max(map(len, tokenizer.get_vocab()), default=1) if tokenizer is not None else 1
        self.max_prompt_chars = self.max_model_len * max(longest_token, 1)

    # --- checks -----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (None: the base model); 404 for an unknown model."""
        if self.models is not None:
            return self.models.lora_request(model)
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return None

    def check_lengths(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str) -> None:
        """400 when the prompt, or the prompt plus max_tokens, does not fit the context."""
        if num_prompt_tokens > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"{prompt_param} has {num_prompt_tokens} tokens. Please reduce the length of the "
                f"{prompt_param}.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if (
            self.max_context_len is not None
            and max_tokens is not None
            and num_prompt_tokens + max_tokens > self.max_model_len
        ):
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                f"{prompt_param}, {max_tokens} in the completion). Please reduce the length of the "
                f"{prompt_param} or completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )

    @staticmethod
    def check_request_options(request: SamplingRequest) -> None:
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        log_advisory_fields(request)

    async def sampling_params(
        self,
        request: SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams, its output constraint compiled (in a worker thread)."""
        try:
            params = request.to_sampling_params(max_tokens, logprobs, prompt_logprobs)
        except ValueError as e:
            fields = (*type(request).model_fields, "structured_outputs.json", "structured_outputs.regex")
            raise APIError(400, str(e), param=_named_field(str(e), fields)) from e
        if request.stream and params.best_of != params.n:
            raise APIError(400, "best_of must equal n when streaming", param="best_of")
        await self.compile_structured_outputs(params, request.structured_outputs_field)
        return params

    async def compile_structured_outputs(self, params: SamplingParams, field: str | None) -> None:
        """Compile the output constraint off the event loop (the engine then finds it compiled);
        400 naming ``field`` when it does not compile in time."""
        structured = params.structured_outputs
        if structured is None:
            return
        manager = self.engine.structured_output_manager
        if manager is None:
            raise APIError(400, "structured outputs need a tokenizer, and this model has none", param=field)
        if not manager.is_ready:
            # A native build is no request's compile time: retry once it is done.
            message = "structured outputs are not ready: the grammar extension is being built "
            message += "(about a minute, once per machine); try again shortly"
            raise APIError(503, message, param=field, code="grammar_building")
        try:
            structured.compiled_grammar = await asyncio.wait_for(
                asyncio.wrap_future(manager.compile(structured)), COMPILE_TIMEOUT_S
            )
        except ValueError as e:
            raise APIError(400, str(e), param=field) from e
        except asyncio.TimeoutError as e:
            raise APIError(
                400, f"the output constraint did not compile in {COMPILE_TIMEOUT_S:g} s", param=field
            ) from e

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """400 for a prompt of more characters than max_model_len tokens can hold, before the
        tokenizer spends a second on it."""
        if num_chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"{param} has {num_chars} characters, more than this model's maximum context length "
                f"of {self.max_model_len} tokens can hold (at most {self.max_prompt_chars} characters).",
                param=param,
            )

    async def encode(
        self, text: str, param: str, add_special_tokens: bool = True, bounded: bool = True
    ) -> list[int]:
        """``text``'s token ids, tokenized off the event loop; ``bounded``: refused (naming
        ``param``) when it has more characters than the context can hold."""
        if self._encoder is None:
            raise APIError(400, "this model has no tokenizer: give the prompt as token ids", param=param)
        if bounded:
            self.check_prompt_chars(len(text), param)
        return await self.in_tokenize_thread(
            lambda tokenizer: tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        )

    async def in_tokenize_thread(self, work: Callable[[Tokenizer], _T]) -> _T:
        """``work(tokenizer)`` in the tokenizing thread, with its copy of the tokenizer."""
        encoder = self._encoder
        assert encoder is not None
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, work, encoder)

    def decode_token(self, token_id: int, logprob: Logprob | None, as_token_id: bool = False) -> str:
        if as_token_id:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    # --- the engine -------------------------------------------------------------------------

    async def add_requests(
        self,
        request_id: str,
        prompts: list[EnginePrompt],
        params: SamplingParams | PoolingParams,
        arrival_time: float,
        raw_request: Request,
        stream: bool,
        lora_request: LoRARequest | None = None,
    ) -> tuple[list[RequestStream], DisconnectGuard]:
        """Queue one engine request per prompt; the guard aborts them all when the client leaves,
        even while the later ones are still being queued. With ``stream`` each output holds what
        is new since the last (DELTA: the engine's frontend diffs, not the handler); without, one
        output at the end (FINAL_ONLY; always, for a pooling model's PoolingParams).

        Refusals become APIErrors before anything streams; a refused prompt withdraws the others.
        """
        pooling = isinstance(params, PoolingParams)
        if not pooling:
            params.output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        engine_ids = [f"{request_id}-{next(_engine_request_counter)}" for _ in prompts]
        guard = DisconnectGuard(self.engine, raw_request, engine_ids)
        streams: list[RequestStream] = []
        try:
            for engine_request_id, prompt in zip(engine_ids, prompts):
                if guard.disconnected:
                    raise APIError(499, "the client disconnected", code="client_disconnected")
                streams.append(
                    await self.engine.add_request(
                        engine_request_id,
                        prompt=prompt.text,
                        sampling_params=None if pooling else params,
                        prompt_token_ids=prompt.token_ids,
                        arrival_time=arrival_time,
                        lora_request=lora_request,
                        pooling_params=params if pooling else None,
                    )
                )
        except BaseException as e:
            guard.close()
            if isinstance(e, ValueError):
                fields = ("prompt", *type(params).__dataclass_fields__)
                raise APIError(400, str(e), param=_named_field(str(e), fields)) from e
            if isinstance(e, AsyncEngineDeadError):
                raise APIError(503, str(e), code="engine_unavailable") from e
            raise
        return streams, guard

    @staticmethod
    async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
        """Each stream's finished output; APIError if one was aborted or failed."""
        finals: list[RequestOutput] = []
        for stream in streams:
            final = None
            try:
                async for output in stream:
                    final = output
            except AsyncEngineDeadError as e:  # the server shutting down, or the engine gone
                raise APIError(503, str(e), code="engine_unavailable") from e
            except Exception as e:
                raise APIError(500, str(e)) from e
            if final is None or not final.finished:
                raise APIError(500, f"request {stream.request_id} was aborted")
            finals.append(final)
        return finals


class DisconnectGuard:
    """Aborts requests when their client disconnects, from creation until ``close()`` (or the end
    of a ``with`` block), which also aborts those still unfinished: the engine must not keep
    generating for nobody.

    It starts watching at creation, before a streamed response sends anything: if the client is
    gone before the body is iterated at all, the requests are still aborted.
    """

    def __init__(self, engine: AsyncLLMEngine, raw_request: Request, request_ids: list[str]) -> None:
        self.engine = engine
        self.request_ids = request_ids
        self.disconnected = False
        self._watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
        self._watcher.add_done_callback(self._on_disconnect)

    def _on_disconnect(self, watcher: asyncio.Future[None]) -> None:
        if watcher.cancelled():
            return
        if watcher.exception() is None:
            self.disconnected = True
            logger.info("client disconnected: aborting %s", ", ".join(self.request_ids))
        self.engine.abort(self.request_ids)

    def close(self) -> None:
        self._watcher.cancel()
        # Requests that finished are no longer known to the engine: this only ends the others.
        self.engine.abort(self.request_ids)

    def __enter__(self) -> DisconnectGuard:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as outputs arrive; errors propagate."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as e:
            queue.put_nowait((index, e))
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_open = len(streams)
        while num_open:
            index, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def log_advisory_fields(request: Any) -> None:
    """Log, once per process, each advisory field (protocol.ADVISORY_FIELDS) a request gave."""
    given = sorted(set(ADVISORY_FIELDS) & request.model_fields_set - _logged_advisory_fields)
    for name in given:
        if getattr(request, name) is not None:
            _logged_advisory_fields.add(name)
            logger.info("accepting the advisory field %r, which does not change the output here", name)


def new_request_id(raw_request: Request) -> str:
    """The client's X-Request-Id when given (so its logs and ours match; at most 128 printable
    characters kept), else a random one. Engine ids add a counter to it, so they never clash."""
    given = raw_request.headers.get(REQUEST_ID_HEADER, "")
    given = "".join(c for c in given[:128] if c.isprintable())
    return given or uuid.uuid4().hex


def prompt_logprobs_json(
    serving: OpenAIServing, final: RequestOutput, as_token_ids: bool
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first), token id -> logprob,
    rank and text."""
    if final.prompt_logprobs is None:
        return None
    return [
        None
        if step is None
        else {
            str(token_id): {
                "logprob": clamp_logprob(logprob.logprob),
                "rank": logprob.rank,
                "decoded_token": serving.decode_token(token_id, logprob, as_token_ids),
            }
            for token_id, logprob in step.items()
        }
        for step in final.prompt_logprobs
    ]


def usage_info(finals: list[RequestOutput]) -> UsageInfo:
    """Token counts over requests' whole outputs (the n returned sequences of each)."""
    prompt_tokens = sum(len(final.prompt_token_ids) for final in finals)
    completion_tokens = sum(len(output.token_ids) for final in finals for output in final.outputs)
    return usage(prompt_tokens, completion_tokens)


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def sse_error(error: Exception) -> str:
    """An error after the response headers went out travels as an event (as vLLM sends it)."""
    return f"data: {APIError(500, str(error)).body().model_dump_json()}\n\n"


def _named_field(message: str, fields: Iterable[str]) -> str | None:
    """The field a ValueError names: SamplingParams' and the engine's messages start with it."""
    first_word = message.split(" ", 1)[0]
    if first_word.startswith("structured_outputs."):
        return "structured_outputs"
    return first_word if first_word in fields else None


async def _wait_for_disconnect(raw_request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass
