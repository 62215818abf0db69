"""What the engine sends its workers each step: one typed object, nothing else crosses."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.sampling_params import SamplingParams


@dataclass
class ScheduledSequence:
    """One sequence's share of the step."""

    seq_id: int
    # The tokens whose K/V this step computes: positions num_computed_tokens .. + len(token_ids).
    token_ids: list[int]
    num_computed_tokens: int
    # Physical block numbers of the sequence's logical blocks, in order.
    block_table: list[int]
    # True when token_ids reach the end of the sequence: the step samples its next token.
    do_sample: bool
    # Tokens generated so far (for min_tokens).
    num_output_tokens: int


@dataclass
class SequenceGroupMetadata:
    """One request's scheduled sequences and how to sample them."""

    request_id: str
    sampling_params: SamplingParams
    seqs: list[ScheduledSequence]
    # Tokens drawn per sampling sequence: best_of on an unforked request's first sample, else 1.
    num_samples: int
    # EOS (unless ignore_eos) and stop_token_ids: banned while a sequence is under min_tokens.
    stop_token_ids: list[int]


@dataclass
class ExecuteModelRequest:
    seq_groups: list[SequenceGroupMetadata]
    # Cache operations to finish before the forward pass, in this order: swap out, swap in, copy.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Requests that ended since the last step: workers drop their per-request state.
    finished_request_ids: list[str] = field(default_factory=list)
