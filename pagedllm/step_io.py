"""What crosses between the scheduler and the workers each step: one SchedulerOutput in, one
ModelRunnerOutput back, through a StepHandle that every executor returns. Nothing else crosses, so
the messages are plain picklable data.

This module is the lowest layer of the package: it imports nothing of it but ``sampling_params``
and ``lora.request`` (leaves),
and the scheduler, the workers, the executors and the engine all speak in its types.

Workers keep a persistent batch (worker/input_batch.py): a request is sent in full once
(``NewRequestData``: when it is admitted, resumed after preemption, forked, or its tokens were
chosen on the host) and afterwards only as a diff (``CachedRequestData``: the blocks it gained
and how far it is computed). A decode step of 256 running requests is therefore a few integer
lists, not 256 token lists and block tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have no row for, in full."""

    req_id: int
    # Seed of the request's own generator (None: the global one). Siblings get distinct seeds
    # derived from the user's, so each one's tokens do not depend on how the others are scheduled.
    seed: int | None
    prompt_token_ids: list[int]
    # Tokens generated so far (a resumed or forked request); the next input continues after them.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Rows drawn from this request's last position when it samples (best_of on a first sample).
    num_samples: int
    # Tokens banned until min_tokens outputs exist (EOS unless ignore_eos, and stop_token_ids).
    min_tokens_stop_ids: list[int]
    # Most likely tokens returned per sample: max(logprobs, beam search's candidates).
    num_top_tokens: int
    # The adapter it runs with (enable_lora), or None.
    lora_request: LoRARequest | None = None
    # Its row of the recurrent-state cache (hybrid models, core/state_cache.py); -1: none.
    state_slot: int = -1


@dataclass
class CachedRequestData:
    """Running requests the workers already hold, as diffs; the lists are parallel."""

    req_ids: list[int] = field(default_factory=list)
    # Per request: None, or (first changed index, block ids from there on) of its block table.
    block_table_diffs: list[tuple[int, list[int]] | None] = field(default_factory=list)
    # Tokens whose K/V are in the cache before this step.
    num_computed_tokens: list[int] = field(default_factory=list)


# A draft id the scheduler does not know: the worker proposed the draft and holds it on the device
# (a draft model's or an EAGLE head's; with asynchronous scheduling its proposals are still on
# their way when the next step is scheduled).
DRAFT_PLACEHOLDER = -1


@dataclass
class SchedulerOutput:
    """One step: which requests compute how many tokens, and the block moves to do first."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    # req_id -> tokens computed this step; a request samples when they reach its end.
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests that ended since the last step: workers drop their rows and generators.
    finished_req_ids: set[int] = field(default_factory=set)
    # Requests preempted since the last step: workers drop their rows (they come back new).
    preempted_req_ids: set[int] = field(default_factory=set)
    # Cache operations before the forward pass, in this order: swap out, swap in, copy.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Then, for a model with recurrent state: (source slot, destination slot) rows of every
    # linear-attention layer's state to copy, a fork's from its parent (core/state_cache.py).
    state_slots_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Behind a sliding window: req_id -> tokens whose blocks left the table (their count changed,
    # or the request is sent in full). The attention kernels see a token at position p (past
    # them) at cache position p - this; rotary embeddings still see p.
    num_dropped_tokens: dict[int, int] = field(default_factory=dict)
    # Speculative decoding: req_id -> draft tokens to verify, scheduled after the request's newest
    # token (they count in num_scheduled_tokens; core/spec_decode.py).
    scheduled_spec_decode_tokens: dict[int, list[int]] = field(default_factory=dict)
    # Whether the scheduler drafts at this step's batch size (False past disable_by_batch_size
    # running requests): a drafter with no state of its own then makes no proposals after it.
    drafting: bool = True
    # With asynchronous scheduling: cached requests whose num_computed_tokens counts the drafts of
    # the step before as accepted (its output had not reached the scheduler); each worker takes
    # back those it rejected.
    optimistic_req_ids: set[int] = field(default_factory=set)

    @property
    def has_forward(self) -> bool:
        return self.total_num_scheduled_tokens > 0


@dataclass
class PromptLogprobsOutput:
    """Logprobs of prompt tokens ``start + 1 .. start + len(token_ids)`` scored by one step:
    position p's logits score prompt token p + 1."""

    start: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class ModelRunnerOutput:
    """The samples of one step, one row per sample drawn (a request repeats on a best_of first
    sample, or for each token a verification of drafts emits), in the order of ``req_ids``."""

    req_ids: list[int] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    # The chosen tokens' logprobs under the model (log_softmax of the raw logits).
    logprobs: list[float] = field(default_factory=list)
    # Row -> (rank of the chosen token, top token ids, their logprobs), for rows that asked.
    top_tokens: dict[int, tuple[int, list[int], list[float]]] = field(default_factory=dict)
    # req_id -> the prompt logprobs this step scored.
    prompt_logprobs: dict[int, PromptLogprobsOutput] = field(default_factory=dict)
    # req_id -> drafts accepted, for each request that verified drafts: its rows (consecutive) are
    # the accepted drafts, then one token sampled from the target after them.
    num_accepted_tokens: dict[int, int] = field(default_factory=dict)
    # Speculative decoding with a draft model or an EAGLE head: req_id -> the drafts the worker
    # proposed after this step's tokens (worker/draft_model.py). The worker keeps them on the
    # device and verifies them when the scheduler schedules placeholders for them.
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Pooling models: req_id -> the pooled vector of each request whose prompt the step completed
    # (in place of a sample; worker/pooling_runner.py).
    pooler_output: dict[int, list[float]] = field(default_factory=dict)


class StepHandle(Protocol):
    """A launched step. ``get()`` waits for its samples (on the device, in another process or on
    other ranks) and returns them; the engine schedules the next step before it calls it."""

    def get(self) -> ModelRunnerOutput: ...


# --- between the engine core and its frontend ---------------------------------------------------


@dataclass
class EngineCoreRequest:
    """A request as the core takes it: validated and tokenized by the frontend's processor."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # The tokens that end a sequence (the core ignores them with ``ignore_eos``).
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    # The adapter it runs with (enable_lora; checked by the processor), or None.
    lora_request: LoRARequest | None = None
    # Whether the frontend needs each token as it is sampled (it streams, matches stop strings,
    # returns logprobs, or fans out). Otherwise the core reports the request's first token (its
    # time to first token) and then the rest at its end: no output per token and step to build,
    # send and apply.
    reports_each_token: bool = True


# A sampled token's logprob, its rank, and the top tokens with theirs (when logprobs were asked).
TokenLogprobs = tuple[float, int, list[int], list[float]]


@dataclass(slots=True)
class EngineCoreOutput:
    """What one output sequence gained in a step: token ids only, never text.

    ``index`` is the sequence's place among its request's outputs; an index the frontend has not
    seen is a sequence forked this step (``new_token_ids`` is then its whole output).
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    # Per new token, when the request asked for logprobs; else None.
    new_logprobs: list[TokenLogprobs] | None
    cumulative_logprob: float
    # None while it runs; "stop", "length", "abort" or "error" once it ended.
    finish_reason: str | None = None
    # The stop token id that ended it (None for EOS, a length limit, or still running).
    stop_reason: int | None = None
    # A pooling model's vector for the request (its only output; no tokens), else None.
    pooling_output: list[float] | None = None


@dataclass
class EngineCoreOutputs:
    """A step's news for the frontend: small, append-only, so it crosses a process pipe as is."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    # request_id -> prompt logprobs scored this step.
    prompt_logprobs: dict[str, PromptLogprobsOutput] = field(default_factory=dict)
    # Requests whose sequence list is exactly their ``outputs`` this step, each with its whole
    # token ids (beam search re-chooses its beams every step, and ends on its hypotheses).
    replaced_request_ids: set[str] = field(default_factory=set)
    # Requests the core ended (every sequence finished), with why they ended early (None if they
    # ran their course): the frontend builds their final output.
    finished_requests: dict[str, str | None] = field(default_factory=dict)
    # request_id -> when the core first scheduled it, sent with the request's first token.
    first_scheduled: dict[str, float] = field(default_factory=dict)
    # request_id -> (draft tokens verified, accepted) over its life, sent when it ends (speculative
    # decoding).
    spec_decoding: dict[str, tuple[int, int]] = field(default_factory=dict)
