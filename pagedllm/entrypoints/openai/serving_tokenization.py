"""POST /tokenize and /detokenize (vLLM's): the server's tokenizer and chat template, no engine."""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import APIError, OpenAIServing
from pagedllm.request_validation import check_token_ids


class OpenAIServingTokenization(OpenAIServing):
    def __init__(self, *args: Any, chat: OpenAIServingChat, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Messages render as chat completions render them (same template rules, off the loop).
        self.chat = chat

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="prompt")
        if request.messages is not None:
            chat_request = ChatCompletionRequest(
                messages=request.messages, add_generation_prompt=request.add_generation_prompt
            )
            tokens = await self.chat.render(chat_request, bounded=False)
        else:
            # Unbounded: /tokenize answers how long a text is, fitting or not (the body limit bounds it).
            tokens = await self.encode(
                request.prompt, "prompt", add_special_tokens=bool(request.add_special_tokens), bounded=False
            )
        token_strs = None
        if request.return_token_strs:
            token_strs = await self.in_tokenize_thread(
                lambda tokenizer: tokenizer.convert_ids_to_tokens(tokens)
            )
        return TokenizeResponse(
            count=len(tokens), max_model_len=self.max_model_len, tokens=tokens, token_strs=token_strs
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        try:
            tokens = check_token_ids(request.tokens, self.engine.config.model_config.vocab_size, "tokens")
        except ValueError as e:
            raise APIError(400, str(e), param="tokens") from e
        return DetokenizeResponse(
            prompt=await self.in_tokenize_thread(lambda tokenizer: tokenizer.decode(tokens))
        )
