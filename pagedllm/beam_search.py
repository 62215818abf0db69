"""What ``LLM.beam_search`` returns (vLLM's ``vllm.beam_search`` types)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.request import Logprob


@dataclass
class BeamSearchSequence:
    """One finished beam.

    Args:
        tokens: the prompt's token ids, then the beam's.
        logprobs: per generated token, its logprob (and the top ones'); empty when not kept.
        cum_logprob: the sum of the generated tokens' logprobs.
        text: ``tokens`` decoded, the prompt included (None without a tokenizer).
        finish_reason, stop_reason: as CompletionOutput's.
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's beams, best first."""

    sequences: list[BeamSearchSequence]
