"""What is left of one step's limits while the scheduler fills it: tokens, sequences, adapters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepBudget:
    """What is left of this step's token and sequence limits."""

    token_budget: int
    max_num_seqs: int
    num_batched_tokens: int = 0
    num_seqs: int = 0
    # Distinct LoRA adapters of the running requests and of those admitted since, at most
    # max_loras (None: no LoRA): each needs a slot of the workers' stacked adapter weights.
    max_loras: int | None = None
    lora_ids: set[int] = field(default_factory=set)

    @property
    def remaining_tokens(self) -> int:
        return self.token_budget - self.num_batched_tokens

    def can_add_seqs(self, num_seqs: int) -> bool:
        return self.num_seqs + num_seqs <= self.max_num_seqs

    def admit_lora(self, lora_int_id: int) -> bool:
        """Count the adapter (0: none) in, or return False when the step has max_loras others
        (the request then waits in its queue for a slot)."""
        if not lora_int_id or lora_int_id in self.lora_ids or self.max_loras is None:
            return True
        if len(self.lora_ids) >= self.max_loras:
            return False
        self.lora_ids.add(lora_int_id)
        return True
