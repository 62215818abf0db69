"""The served models: the base model and its LoRA adapters (vLLM's ``OpenAIServingModels``).

A request's ``model`` field picks what runs: the base model's name, or an adapter's name (the
request then runs with that adapter). Adapters come from ``--lora-modules`` at start and from
``POST /v1/load_lora_adapter`` while serving (``/v1/unload_lora_adapter`` removes one: requests
already running with it finish). ``/v1/models`` lists the adapters with the base as parent.
"""

from __future__ import annotations

import asyncio
import itertools

from pydantic import Field

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.openai.protocol import ModelCard, OpenAIBaseModel
from pagedllm.entrypoints.openai.serving_engine import APIError
from pagedllm.lora.peft import check_adapter
from pagedllm.lora.request import LoRARequest


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class OpenAIServingModels:
    """Args:
    config: the engine's configuration (the base model the adapters must fit, the LoRA limits).
    base_model_name: the served name of the base model.
    lora_modules: (name, path, base model name) of the adapters served from the start; each is
        checked here (ValueError naming it).
    """

    def __init__(
        self, config: EngineConfig, base_model_name: str, lora_modules: list[tuple[str, str, str | None]] = ()
    ) -> None:
        self.config = config
        self.base_model_name = base_model_name
        self._lora_ids = itertools.count(1)
        self.lora_requests: dict[str, LoRARequest] = {}
        for name, path, base_name in lora_modules:
            self._add(self._new_request(name, path, base_name))

    def _new_request(self, name: str, path: str, base_name: str | None = None) -> LoRARequest:
        if self.config.lora_config is None:
            raise ValueError(f"LoRA adapter {name!r}: the server was started without --enable-lora")
        if name == self.base_model_name or name in self.lora_requests:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        lora = LoRARequest(name, next(self._lora_ids), path, base_name)
        check_adapter(lora, self.config.model_config.hf_config, self.config.lora_config)
        return lora

    def _add(self, lora: LoRARequest) -> None:
        self.lora_requests[lora.lora_name] = lora

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for an unknown name."""
        if model is None or model == self.base_model_name:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return lora

    def cards(self) -> list[ModelCard]:
        max_model_len = self.config.model_config.max_model_len
        base = ModelCard(id=self.base_model_name, root=self.base_model_name, max_model_len=max_model_len)
        adapters = [
            ModelCard(
                id=lora.lora_name,
                root=lora.lora_name,
                parent=lora.base_model_name or self.base_model_name,
                max_model_len=max_model_len,
            )
            for lora in self.lora_requests.values()
        ]
        return [base, *adapters]

    def card(self, model: str) -> ModelCard:
        self.lora_request(model)
        return next(card for card in self.cards() if card.id == model)

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        """Check the adapter (off the event loop: it reads files) and serve it; 400 when refused."""
        try:
            lora = await asyncio.to_thread(self._new_request, request.lora_name, request.lora_path)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path" if "already" not in str(e) else "lora_name") from e
        if lora.lora_name in self.lora_requests:  # loaded by another request meanwhile
            message = f"The lora adapter '{lora.lora_name}' has already been loaded."
            raise APIError(400, message, param="lora_name")
        self._add(lora)
        return f"Success: LoRA adapter '{lora.lora_name}' added successfully."

    def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        """Stop serving the adapter (404 when none has the name); requests running with it finish."""
        lora = self.lora_requests.get(request.lora_name)
        if lora is None or (request.lora_int_id is not None and request.lora_int_id != lora.lora_int_id):
            message = f"The lora adapter '{request.lora_name}' cannot be found."
            raise APIError(404, message, param="lora_name", code="not_found")
        del self.lora_requests[request.lora_name]
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."
