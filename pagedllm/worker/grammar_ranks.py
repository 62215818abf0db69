"""Structured outputs under tensor parallelism: one rank keeps the grammars, every rank applies
their bitmask.

Every rank samples the same tokens from the same gathered logits, so every rank needs the step's
grammar bitmask, but only one needs the grammars that make it. Rank 0 (whose samples the engine
reads) compiles each constraint and advances its matcher (``GrammarConstraint``); after filling
the step's bitmask it broadcasts it over the tensor-parallel group (``SourceGrammarMask``). The
other ranks receive it (``ReceivedGrammarMask``): they hold no matcher, no tokenizer view of the
vocabulary (30-70 MB) and compile nothing. vLLM's engine makes the bitmask in its scheduler and
sends it with the step; here it stays beside the sampler, where rank 0's native thread makes the
next step's masks while the device runs this one.

Whether a step has a bitmask to share is read from the rows' sampling parameters, which every
rank holds alike: a step with a constrained row always broadcasts (rows whose grammar ended allow
every token), one without never does. The message is [rows, ceil(vocab / 32)] int32: 4.7 KB a row
of Qwen3's 151,936-token vocabulary, on the device over NCCL (gloo on the CPU).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from pagedllm.config import ModelConfig
from pagedllm.distributed import tensor_model_parallel_broadcast
from pagedllm.sample.constraints import ConstraintRows, SampledRequest
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import CompiledGrammar, StructuredOutputManager, bitmask_words
from pagedllm.tokenizer import get_tokenizer
from pagedllm.worker.request_logits import GrammarConstraint, GrammarSeam


def grammar_constraint(
    model_config: ModelConfig, rank: int, world_size: int, fill_ahead: bool, samples: bool = True
) -> GrammarSeam:
    """This rank's part in structured outputs: the grammars alone (one rank), the grammars and
    their broadcast (rank 0 of several), or the received bitmask (the other ranks). ``rank`` and
    ``world_size`` are the tensor-parallel group's; a pipeline stage that does not sample
    (``samples`` False) holds no grammar."""
    if rank > 0 or not samples:
        return ReceivedGrammarMask()
    grammars = GrammarConstraint(RankGrammarCompiler(model_config), fill_ahead)
    return grammars if world_size == 1 else SourceGrammarMask(grammars)


def _has_grammar(rows: ConstraintRows) -> bool:
    return any(params.structured_outputs is not None for params in rows.params)


def _bitmask_shape(logits: torch.Tensor) -> tuple[int, int]:
    return logits.shape[0], bitmask_words(logits.shape[1])


class SourceGrammarMask:
    """Rank 0's grammars (``GrammarConstraint``), their bitmask broadcast to the other ranks."""

    def __init__(self, grammars: GrammarConstraint) -> None:
        self.grammars = grammars

    def drop(self, req_ids: Iterable[int]) -> None:
        self.grammars.drop(req_ids)

    def before_sampling(self, logits: torch.Tensor, rows: ConstraintRows) -> torch.Tensor | None:
        bitmask = self.grammars.before_sampling(logits, rows)
        if not _has_grammar(rows):
            return bitmask
        if bitmask is None:  # every grammar ended: the other ranks still wait for a mask
            shared = torch.full(_bitmask_shape(logits), -1, dtype=torch.int32, device=logits.device)
        else:
            # Queued before ``after_launch`` records the event that frees the pinned host buffer.
            shared = bitmask.to(logits.device, non_blocking=True)
        return tensor_model_parallel_broadcast(shared, src=0)

    def after_launch(self, samples: torch.Tensor, requests: Sequence[SampledRequest]) -> None:
        self.grammars.after_launch(samples, requests)


class ReceivedGrammarMask:
    """A rank other than 0: the step's bitmask as rank 0 made it."""

    def drop(self, req_ids: Iterable[int]) -> None:
        pass

    def before_sampling(self, logits: torch.Tensor, rows: ConstraintRows) -> torch.Tensor | None:
        if not _has_grammar(rows):
            return None
        received = torch.empty(_bitmask_shape(logits), dtype=torch.int32, device=logits.device)
        return tensor_model_parallel_broadcast(received, src=0)

    def after_launch(self, samples: torch.Tensor, requests: Sequence[SampledRequest]) -> None:
        pass


class RankGrammarCompiler:
    """For a rank 0 in a process of its own: the engine's compiled grammar does not cross
    processes (a native matcher), so the rank compiles the constraint, at its first step (once per
    constraint: the manager caches them)."""

    def __init__(self, model_config: ModelConfig) -> None:
        self._model_config = model_config
        self._manager: StructuredOutputManager | None = None  # made at the first grammar

    def __call__(self, params: StructuredOutputsParams) -> CompiledGrammar:
        if self._manager is None:
            manager = StructuredOutputManager.for_model(self._model_config, get_tokenizer(self._model_config))
            if manager is None:
                raise ValueError("structured_outputs needs a tokenizer, and this model has none")
            self._manager = manager
        return self._manager.compile(params).result()
