"""LoRAConfig: how many adapters an engine serves at once, and how large they may be."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's LoRA limits.

    ``max_loras`` adapters can be in one step (each owns a slot of the stacked weights on the
    device); ``max_lora_rank`` is the rank every slot is sized for (smaller ranks are padded with
    zeros); ``max_cpu_loras`` adapters stay loaded on the host (an LRU) so a slot can be refilled
    without reading the adapter's files again.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or isinstance(cpu, bool) or cpu < self.max_loras):
            raise ValueError(
                f"max_cpu_loras must be an int >= max_loras ({self.max_loras}) or None, got {cpu!r}"
            )

    @property
    def num_cpu_loras(self) -> int:
        """Adapters kept loaded on the host: max_cpu_loras, or max_loras when unset (vLLM's default)."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
