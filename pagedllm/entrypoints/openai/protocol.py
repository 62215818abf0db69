"""The OpenAI API's request and response bodies (pydantic), with vLLM's extra sampling fields.

Requests check types only: value ranges are SamplingParams' to check (one place), and its
ValueErrors become 400 answers naming the field. A request field this server does not know is a
400 naming it (``extra="forbid"``), never silently ignored.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestModel(BaseModel):
    # An option this server does not honour must not pass unnoticed: the 400 names it.
    model_config = ConfigDict(extra="forbid")


class TopLevelRequest(RequestModel):
    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        # JSON may escape half a UTF-16 pair ("\ud800"); Python keeps it, and no tokenizer or
        # encoder takes it later.
        path = _lone_surrogate_path(data, ())
        if path is not None:
            raise ValueError(f"{'.'.join(map(str, path)) or 'body'} has a lone UTF-16 surrogate")
        return data


def _lone_surrogate_path(value: Any, path: tuple) -> tuple | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _lone_surrogate_path(key, ()) is not None:
            return (*path, "key")
        found = _lone_surrogate_path(item, (*path, key))
        if found is not None:
            return found
    return None


# --- requests ---------------------------------------------------------------------------------


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    # vLLM's: usage in every chunk, not only the last.
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(RequestModel):
    name: str = "response"
    description: str | None = None
    # "schema" shadows a BaseModel attribute: the field is json_schema, "schema" in JSON.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# Fields newer OpenAI clients send that do not change the output: bookkeeping on OpenAI's side,
# or hints this server has no use for (prefix caching is automatic, so ``prompt_cache_key`` only
# names what it would find anyway). They are accepted and logged once (vLLM accepts and logs
# extra fields); a field that would change the output and is not honoured stays a 400.
ADVISORY_FIELDS = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "verbosity",
    "prediction",
    "modalities",
)


class SamplingRequest(TopLevelRequest):
    """The fields completions and chat completions share. ``None`` (JSON null) means the default."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # Predicted outputs speed OpenAI's decoding up; the output is the same without them.
    prediction: dict[str, Any] | None = None
    # Only text is generated here: ["text"] is accepted, audio is refused (a 400 naming it).
    modalities: list[Literal["text"]] | None = None
    # vLLM's extras.
    best_of: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    use_beam_search: bool | None = False
    length_penalty: float | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = False
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def to_sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        given = {
            name: getattr(self, name)
            for name in (
                "n",
                "best_of",
                "frequency_penalty",
                "presence_penalty",
                "repetition_penalty",
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "stop",
                "stop_token_ids",
                "ignore_eos",
                "min_tokens",
                "skip_special_tokens",
                "spaces_between_special_tokens",
                "include_stop_str_in_output",
                "use_beam_search",
                "length_penalty",
                "bad_words",
                "allowed_token_ids",
                "logit_bias",
                "truncate_prompt_tokens",
            )
            if getattr(self, name) is not None
        }
        if self.prompt_logprobs is not None:
            prompt_logprobs = self.prompt_logprobs
        return SamplingParams(
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=self.structured_outputs_params(),
            **given,
        )

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one output constraint asked for, whichever field asked; ValueError naming the field
        when several did."""
        constraints: dict[str, StructuredOutputsParams] = {}
        if self.structured_outputs is not None:
            try:
                constraints["structured_outputs"] = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs has an unknown key: {e}") from None
        for field, key in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            if getattr(self, field) is not None:
                constraints[field] = StructuredOutputsParams(**{key: getattr(self, field)})
        if self.response_format is not None and self.response_format.type != "text":
            constraints["response_format"] = response_format_constraint(self.response_format)
        if len(constraints) > 1:
            raise ValueError(f"{' and '.join(constraints)} both constrain the output: give one")
        return next(iter(constraints.values()), None)

    @property
    def structured_outputs_field(self) -> str | None:
        """The request field that asked for an output constraint."""
        for field in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, field) is not None:
                return field
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        return None

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage_in_stream and self.stream_options.continuous_usage_stats)


def response_format_constraint(response_format: ResponseFormat) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.json_schema is None or response_format.json_schema.json_schema is None:
        raise ValueError("response_format must give json_schema.schema with type json_schema")
    return StructuredOutputsParams(json=response_format.json_schema.json_schema)


class CompletionRequest(SamplingRequest):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    # JSON text, as OpenAI sends it.
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageParam(OpenAIBaseModel):
    # Clients send back assistant messages as they got them (refusal, annotations, audio: null):
    # unknown keys of a message are ignored, unlike the request's own.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or content parts ([{"type": "text", "text": ...}]).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Passed to chat templates that take it (gpt-oss'); a 400 naming it for those that do not.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's extras.
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    echo: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# --- responses --------------------------------------------------------------------------------


class ResponseHeader(OpenAIBaseModel):
    """The fields an OpenAI response object opens with, in OpenAI's order. Each response narrows
    ``object`` to its own Literal; a stream's chunks make ``created`` required (they share one)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    # A LoRA adapter's base model.
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    # vLLM's: per prompt token (None for the first), token id -> its logprob and text.
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(ResponseHeader):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(ResponseHeader):
    object: Literal["text_completion"] = "text_completion"
    created: int
    choices: list[CompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    # vLLM's, with --reasoning-parser: the thinking before the answer.
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(ResponseHeader):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    # vLLM's, with ``prompt_logprobs`` asked for (see CompletionResponseChoice).
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI's deltas carry only what changed: {"role": ...} first, then {"content": ...}, {} last.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(ResponseHeader):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    choices: list[ChatCompletionResponseStreamChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None


def sse_event(chunk: BaseModel, include_usage: bool) -> str:
    """One server-sent event. Chunks carry ``usage`` (null until the last) only when the client
    asked for it with stream_options.include_usage, as OpenAI's do."""
    exclude = None if include_usage else {"usage"}
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# --- tokenizer endpoints (vLLM's) -------------------------------------------------------------


class TokenizeRequest(TopLevelRequest):
    model: str | None = None
    # A prompt, or chat messages rendered through the chat template.
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(TopLevelRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
