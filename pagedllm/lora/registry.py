"""The engine's adapters: each checked once against the base model before a request runs with
it, and one adapter per ``lora_int_id``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.peft import check_adapter
from pagedllm.lora.request import LoRARequest

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class LoRARegistry:
    """Args:
    lora_config: the engine's LoRA limits, None when ``enable_lora`` is off.
    hf_config: the base model's config (the shapes an adapter must have).
    """

    def __init__(self, lora_config: LoRAConfig | None, hf_config: PretrainedConfig) -> None:
        self.lora_config = lora_config
        self.hf_config = hf_config
        self._checked: dict[int, LoRARequest] = {}

    def check(self, lora_request: LoRARequest | None) -> None:
        """Raise ValueError, naming the field, when a request cannot run with this adapter."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.lora_config is None:
            raise ValueError("lora_request was given, but this engine was not started with enable_lora=True")
        known = self._checked.get(lora_request.lora_int_id)
        if known is not None:
            if known != lora_request:
                raise ValueError(
                    f"lora_int_id {lora_request.lora_int_id} already names adapter {known.lora_name!r} "
                    f"({known.lora_path}): give each adapter its own lora_int_id"
                )
            return
        check_adapter(lora_request, self.hf_config, self.lora_config)
        self._checked[lora_request.lora_int_id] = lora_request
