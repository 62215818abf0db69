"""The messages between the frontend and the engine core loop (core_proc.py): plain data, handed
over as they are in a thread and pickled across a process's pipe.

This module imports no engine (torch, transformers): the frontend's side of an engine process
(engine_process.py) is started with it before the engine is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.config import EngineConfig
from pagedllm.engine.stats import EngineStats
from pagedllm.step_io import EngineCoreOutputs, EngineCoreRequest

# The tokenizer module imports transformers (seconds).
if TYPE_CHECKING:
    from pagedllm.tokenizer import Tokenizer


# --- frontend -> core -------------------------------------------------------------------------


@dataclass
class AddRequest:
    """A request the frontend's processor made; answered by an AddResult with the same op_id."""

    op_id: int
    request: EngineCoreRequest


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class FinishSequences:
    """Sequences, by (request_id, output index), that a stop string ended in the frontend."""

    stopped: list[tuple[str, int]]


# None in the op queue stops the loop.
CoreOp = AddRequest | AbortRequests | FinishSequences | None


# --- core -> frontend -------------------------------------------------------------------------


@dataclass
class AddResult:
    op_id: int
    # Why the request was not queued (ValueError: its constraint does not compile), or None.
    error: Exception | None


@dataclass
class CoreOutputs:
    """A step's outputs (empty after ops alone), and the core's state after it."""

    outputs: EngineCoreOutputs
    stats: EngineStats


@dataclass
class Heartbeat:
    """Sent every HEALTH_CHECK_INTERVAL_S while idle, once the workers are found alive: with the
    outputs of every step, it tells the frontend that the engine is not stuck."""


@dataclass
class EngineDead:
    """The loop ended: the engine gave up (a worker gone, a device fault) or raised."""

    reason: str


@dataclass
class Ready:
    """The engine process's first message: what the frontend needs to validate requests."""

    config: EngineConfig
    tokenizer: Tokenizer | None
    stats: EngineStats
    num_gpu_blocks: int


@dataclass
class StartupFailed:
    error: Exception


CoreMessage = AddResult | CoreOutputs | Heartbeat | EngineDead
