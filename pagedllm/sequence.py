"""Sequences and sequence groups.

A request is a ``SequenceGroup``. It starts with one ``Sequence`` holding the prompt; after the
prompt's first token is sampled it is forked into ``best_of`` sequences that share the prompt's
KV blocks (copy-on-write, see ``BlockSpaceManager.fork``).

Each sequence tracks ``num_computed_tokens``: how many of its tokens have their K/V in the cache.
The scheduler works only with that count and the sequence length; there is no separate prefill or
decode phase. A sequence whose uncomputed tokens are exactly its last sampled token is decoding;
anything more (a new prompt, a recomputed one after preemption, the rest of a chunked prompt) is a
prefill.

Tokens are also kept in logical blocks of ``block_size``: the unit the block manager maps to
physical blocks (and, with prefix caching, the unit that is hashed).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagedllm.engine.beam_search import BeamSearchState
    from pagedllm.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= _FIRST_FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


# A plain int: checked for every sequence several times a step, where an enum lookup costs more.
_FIRST_FINISHED = int(SequenceStatus.FINISHED_STOPPED)
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
}


class LogicalTokenBlock:
    """A block's worth of one sequence's tokens, before it is mapped to physical memory."""

    __slots__ = ("block_hash", "block_number", "block_size", "token_ids")

    def __init__(self, block_number: int, block_size: int) -> None:
        self.block_number = block_number
        self.block_size = block_size
        self.token_ids: list[int] = []
        # Once full: the hash of its tokens and every token before it (the prefix-cache key).
        self.block_hash: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_empty_slots(self) -> int:
        return self.block_size - len(self.token_ids)

    @property
    def is_full(self) -> bool:
        return len(self.token_ids) == self.block_size

    def append_tokens(self, token_ids: list[int]) -> None:
        assert len(token_ids) <= self.num_empty_slots
        self.token_ids.extend(token_ids)

    def copy(self) -> LogicalTokenBlock:
        block = LogicalTokenBlock(self.block_number, self.block_size)
        block.token_ids = self.token_ids.copy()
        block.block_hash = self.block_hash
        return block


@dataclass
class Logprob:
    """One token's log probability and, when asked for, its rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, for the chosen token and the top-k (vLLM's format).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


class Sequence:
    """One output sequence of a request: the prompt plus the tokens generated so far."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], block_size: int) -> None:
        self.seq_id = seq_id
        # Shared, never mutated, by every sequence forked from this one.
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.block_size = block_size
        self.logical_token_blocks: list[LogicalTokenBlock] = []
        self._append_to_blocks(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.cumulative_logprob = 0.0
        self.output_logprobs: SampleLogprobs = []
        # Index of this sequence among the request's outputs (CompletionOutput.index).
        self.output_index = 0
        # Incremental detokenization state (see pagedllm/detokenizer.py).
        self.output_text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_reason: int | str | None = None

    # --- tokens -----------------------------------------------------------------------------

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def get_last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def append_token_id(self, token_id: int, logprob: float) -> None:
        self.output_token_ids.append(token_id)
        self._append_to_blocks([token_id])
        self.cumulative_logprob += logprob

    def _append_to_blocks(self, token_ids: list[int]) -> None:
        cursor = 0
        while cursor < len(token_ids):
            if not self.logical_token_blocks or self.logical_token_blocks[-1].is_full:
                self.logical_token_blocks.append(
                    LogicalTokenBlock(len(self.logical_token_blocks), self.block_size)
                )
            last = self.logical_token_blocks[-1]
            take = min(last.num_empty_slots, len(token_ids) - cursor)
            last.append_tokens(token_ids[cursor : cursor + take])
            cursor += take

    @property
    def num_logical_blocks(self) -> int:
        return len(self.logical_token_blocks)

    def block_hash(self, index: int) -> int:
        """The prefix-cache key of full logical block ``index``: a hash of its tokens chained with
        the key of the block before it, so equal keys mean equal prefixes."""
        blocks = self.logical_token_blocks
        assert blocks[index].is_full, "only full blocks are cached"
        if blocks[index].block_hash is not None:
            return blocks[index].block_hash
        first = index
        while first > 0 and blocks[first - 1].block_hash is None:
            first -= 1
        for i in range(first, index + 1):
            if blocks[i].block_hash is None:
                prev = blocks[i - 1].block_hash if i else None
                blocks[i].block_hash = hash((prev, tuple(blocks[i].token_ids)))
        return blocks[index].block_hash

    # --- progress ---------------------------------------------------------------------------

    def get_num_uncomputed_tokens(self) -> int:
        return self.get_len() - self.num_computed_tokens

    def is_prefill(self) -> bool:
        """More than the last sampled token still needs its K/V computed."""
        return self.get_num_uncomputed_tokens() > 1 or not self.output_token_ids

    def reset_for_recompute(self) -> None:
        """Forget the cache: prompt and outputs are all recomputed as one prefill."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def is_finished(self) -> bool:
        return self.status >= _FIRST_FINISHED

    def fork(self, new_seq_id: int) -> Sequence:
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.seq_id = new_seq_id
        child.output_token_ids = self.output_token_ids.copy()
        child.logical_token_blocks = [block.copy() for block in self.logical_token_blocks]
        child.output_logprobs = self.output_logprobs.copy()
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.name}, len={self.get_len()}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class SequenceGroup:
    """One request: its sequences (one before the first sample, ``best_of`` after)."""

    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    prompt: str | None = None
    # The request's own sampler generator when it has a seed (lives on the device).
    generator: torch.Generator | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # Why the request ended without running (e.g. it can never fit in the KV cache).
    error: str | None = None
    # Live beams' scores and kept hypotheses, for beam search requests.
    beam_state: BeamSearchState | None = None
    # Report every step's progress (else only the end; see LLMEngine.add_request).
    stream: bool = True
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return self.seqs
        return [seq for seq in self.seqs if seq.status == status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if not seq.is_finished()]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.get_seqs(status))

    def num_unfinished_seqs(self) -> int:
        return len(self.get_unfinished_seqs())

    @property
    def is_forked(self) -> bool:
        return len(self.seqs) > 1 or self.sampling_params.best_of == 1

    def get_max_num_running_seqs(self) -> int:
        """Sequences this group will run at once: ``best_of`` until it forks (always, for beam
        search), then the live ones."""
        if self.sampling_params.use_beam_search or not self.is_forked:
            return self.sampling_params.best_of
        return self.num_unfinished_seqs()

    def is_prefill(self) -> bool:
        return any(seq.is_prefill() for seq in self.get_unfinished_seqs())

    def add(self, seq: Sequence) -> None:
        self.seqs.append(seq)

    def is_finished(self) -> bool:
        return all(seq.is_finished() for seq in self.seqs)

    def __repr__(self) -> str:
        return f"SequenceGroup(request_id={self.request_id}, num_seqs={len(self.seqs)})"
