"""What the engine sends its workers each step: one typed object, nothing else crosses."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.layers.sampler import SamplerOutput, SequenceSample
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
    # The generated tokens themselves, only when the request has presence/frequency/repetition
    # penalties (they are counted on the device).
    output_token_ids: list[int] | None = None


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
    # The prompt, only with a repetition penalty (it counts prompt tokens).
    prompt_token_ids: list[int] | None = None
    # Most likely tokens returned per sample: max(logprobs, beam search's candidates).
    num_top_tokens: int = 0
    # Prompt logprobs: positions p of this step whose logits score prompt token p + 1, the
    # tokens they score, and how many top tokens to return with each.
    prompt_logprob_positions: list[int] = field(default_factory=list)
    prompt_logprob_targets: list[int] = field(default_factory=list)
    num_prompt_logprobs: int = 0


@dataclass
class ExecuteModelRequest:
    seq_groups: list[SequenceGroupMetadata]
    # Cache operations to finish before the forward pass, in this order: swap out, swap in, copy.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Requests that ended since the last step: workers drop their per-request state.
    finished_request_ids: list[str] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    # request_id -> its samples, one per sampled row, in row order.
    samples: SamplerOutput
    # request_id -> logprobs of the prompt tokens this step scored (SequenceSample.token_id is the
    # prompt token; parent_seq_id its sequence).
    prompt_logprobs: dict[str, list[SequenceSample]] = field(default_factory=dict)
