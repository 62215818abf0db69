"""The frontend's input side: a caller's request becomes an ``EngineCoreRequest``.

It validates the parameters (``request_validation``: every refusal names the field), tokenizes
the prompt, compiles an output constraint (so that a bad schema is refused here, before the core
sees it) and adds the EOS ids the core stops on. The core then deals in token ids only.
"""

from __future__ import annotations

import time

from pagedllm.config import EngineConfig
from pagedllm.engine.pooling_output import POOLING_SAMPLING_PARAMS
from pagedllm.lora.registry import LoRARegistry
from pagedllm.lora.request import LoRARequest
from pagedllm.request_validation import validate_request
from pagedllm.sampling_params import SamplingParams
from pagedllm.step_io import EngineCoreRequest
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.tokenizer import Tokenizer, get_eos_token_ids


class Processor:
    """Validates and tokenizes requests for a core with ``num_gpu_blocks`` KV blocks.

    ``structured_output_manager`` compiles constraints (None without a tokenizer).
    """

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None, num_gpu_blocks: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.num_gpu_blocks = num_gpu_blocks
        self.eos_token_ids = tuple(sorted(get_eos_token_ids(config.model_config, tokenizer)))
        self.structured_output_manager = StructuredOutputManager.for_model(config.model_config, tokenizer)
        self.lora_registry = LoRARegistry(config.lora_config, config.model_config.hf_config)

    def process(
        self,
        request_id: str,
        prompt: str | None,
        sampling_params: SamplingParams | None,
        prompt_token_ids: list[int] | None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> EngineCoreRequest:
        """The request as the core takes it; bad input raises ValueError naming the field.
        ``lora_request`` (``enable_lora``) is checked against the base model here, once.
        A pooling model's request (its PoolingParams resolved by the caller: ``pooling_output.py``)
        runs with ``POOLING_SAMPLING_PARAMS``.

        A prompt longer than max_model_len passes (``too_long`` says so): the caller reports it
        finished with an error rather than refusing it.
        """
        if self.config.pooler_config is not None:
            if sampling_params is not None:
                raise ValueError(
                    "this engine runs a pooling model (runner='pooling'): it returns embeddings "
                    "(LLM.embed, /v1/embeddings), it does not generate"
                )
            sampling_params = POOLING_SAMPLING_PARAMS
        params = sampling_params or SamplingParams()
        self.lora_registry.check(lora_request)
        token_ids = validate_request(
            params,
            self._prompt_token_ids(prompt, prompt_token_ids),
            self.config,
            self.num_gpu_blocks,
            len(self.eos_token_ids),
            self.tokenizer,
            self.structured_output_manager,
        )
        return EngineCoreRequest(
            request_id, token_ids, params, self.eos_token_ids, arrival_time or time.time(), lora_request
        )

    def too_long(self, request: EngineCoreRequest) -> str | None:
        """Why the request can never run (its prompt exceeds max_model_len), or None."""
        max_model_len = self.config.model_config.max_model_len
        num_tokens = len(request.prompt_token_ids)
        if num_tokens > max_model_len:
            return f"prompt has {num_tokens} tokens, more than max_model_len={max_model_len}"
        return None

    def _prompt_token_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (skip_tokenizer_init): give prompt_token_ids")
            prompt_token_ids = self.tokenizer(prompt)["input_ids"]
        return prompt_token_ids
