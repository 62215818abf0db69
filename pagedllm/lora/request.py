"""The request for an adapter, as vLLM spells it: ``LoRARequest(lora_name, lora_int_id, lora_path)``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """One adapter a request runs with.

    Args:
        lora_name: the adapter's name (what a server request's ``model`` field names).
        lora_int_id: the engine's id for it, >= 1 and unique per adapter (0 means "no adapter").
        lora_path: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).
        base_model_name: the model it was trained on, shown as its parent by ``/v1/models``.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        lora_int_id = self.lora_int_id
        if not isinstance(lora_int_id, int) or isinstance(lora_int_id, bool) or lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name an adapter directory, got {self.lora_path!r}")

    @property
    def cache_salt(self) -> tuple[str, int, str]:
        """What a prefix-cache key starts from for this adapter's requests: the same tokens under
        two adapters have different K/V, so their blocks must never be shared."""
        return (self.lora_name, self.lora_int_id, self.lora_path)
