"""The frontend's output side: the core's token ids become text and RequestOutputs.

The core (``core.py``) sends, per step, what each sequence gained in token ids
(``EngineCoreOutputs``). This module owns everything textual about a request: its incremental
detokenization, stop strings (a sequence whose text completes one is ended here, and handed back
for the core to free), logprobs in vLLM's format (with each token's text), prompt logprobs, the
request's metrics, and the shape of what the caller sees (``SamplingParams.output_kind``):

- CUMULATIVE: every output holds everything so far (``LLMEngine``'s streaming default);
- DELTA: only what is new since the request's previous output (the server streams these: no
  diffing, no re-encoding);
- FINAL_ONLY: one output when the request ends (``LLM.generate``); its text is then decoded once
  at the end unless stop strings need it token by token, which saves host time every step.

While a stop string may still complete, the characters that could start it are held back, so
that streamed text never has to be taken back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagedllm.core.request import Logprob, PromptLogprobs, RequestMetrics, SampleLogprobs
from pagedllm.detokenizer import decode_all, decode_incrementally, init_detokenizer_state
from pagedllm.engine.pooling_output import embedding_head
from pagedllm.engine.stop_checker import check_stop_strings
from pagedllm.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.step_io import EngineCoreOutput, EngineCoreOutputs, PromptLogprobsOutput, TokenLogprobs
from pagedllm.tokenizer import Tokenizer


@dataclass(eq=False)
class SequenceState:
    """One output sequence as the frontend holds it: tokens, text, logprobs, and what was sent."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    logprobs: SampleLogprobs = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The incremental decoder's offsets (``detokenizer.py``).
    prefix_offset: int = 0
    read_offset: int = 0
    # What earlier DELTA outputs held: tokens, characters, and whether the end was sent.
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    sent_finished: bool = False


@dataclass(eq=False)
class RequestState:
    """A user's request as the frontend tracks it, from add to its final output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_kind: RequestOutputKind
    arrival_time: float
    seqs: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    num_sent_prompt_logprobs: int = 0
    # Why the request ended without running to its end.
    error: str | None = None
    finished: bool = False
    # A pooling model's request: its resolved parameters, and its pooled vector once computed.
    pooling_params: PoolingParams | None = None
    pooled: list[float] | None = None
    metrics: RequestMetrics = field(init=False)
    # Characters held back from unfinished text: a stop string may start there.
    holdback: int = field(init=False)
    # Whether its text is decoded token by token: streamed text is needed every step, and stop
    # strings are matched against the text as it grows. Otherwise it is decoded once, at the end.
    decodes_incrementally: bool = field(init=False)
    # Whether it has an output before its end.
    streams: bool = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.holdback = max(self.sampling_params.max_stop_string_len - 1, 0)
        self.streams = self.output_kind != RequestOutputKind.FINAL_ONLY
        self.decodes_incrementally = self.streams or bool(self.sampling_params.stop)

    @property
    def needs_each_token(self) -> bool:
        """Whether it needs each token as it is sampled (``EngineCoreRequest.reports_each_token``):
        to stream it, match stop strings, return its logprobs, or follow a fan-out's sequences."""
        params = self.sampling_params
        return (
            self.decodes_incrementally
            or params.logprobs is not None
            or params.n > 1
            or params.best_of > 1
            or params.use_beam_search
        )

    def seq(self, index: int) -> SequenceState:
        """The sequence at ``index``; a new one the first time (a fork the core just made)."""
        for seq in self.seqs:
            if seq.index == index:
                return seq
        seq = SequenceState(index, self.prompt_token_ids)
        init_detokenizer_state(seq)
        self.seqs.append(seq)
        return seq


class OutputProcessor:
    """Turns EngineCoreOutputs into RequestOutputs; owns every live request's frontend state."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, state: RequestState) -> None:
        self.requests[state.request_id] = state

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(
        self, core_outputs: EngineCoreOutputs
    ) -> tuple[list[RequestOutput | PoolingRequestOutput], list[tuple[str, int]]]:
        """Apply a step's outputs. Returns the RequestOutputs due now, and the sequences that a
        stop string ended, as (request_id, index), for the core to end too."""
        requests = self.requests
        now = time.time()
        for request_id, scored in core_outputs.prompt_logprobs.items():
            state = requests.get(request_id)
            if state is not None:
                self._add_prompt_logprobs(state, scored)
        for request_id, first_scheduled in core_outputs.first_scheduled.items():
            state = requests.get(request_id)
            if state is not None:
                state.metrics.first_scheduled_time = first_scheduled
        # Requests with an output due (streaming ones with news, and any that ended).
        touched: dict[str, RequestState] = {}
        # Sequences a stop string ended here, and their requests: the core reports the end of a
        # request only when it ended the last sequence itself.
        stopped: list[tuple[str, int]] = []
        stopped_requests: set[str] = set()
        replaced = core_outputs.replaced_request_ids
        for output in core_outputs.outputs:
            request_id = output.request_id
            state = requests.get(request_id)
            if state is None:
                continue  # aborted meanwhile
            if request_id in stopped_requests and (request_id, output.index) in stopped:
                continue  # a token after the stop string, in the same verified run of drafts
            if request_id in replaced and request_id not in touched:
                state.seqs = []
            if state.streams or output.finish_reason is not None or request_id in replaced:
                touched[request_id] = state
            elif state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            if self._apply(state, output):
                stopped.append((request_id, output.index))
                stopped_requests.add(request_id)
                touched[request_id] = state
        for request_id, (num_drafts, num_accepted) in core_outputs.spec_decoding.items():
            state = requests.get(request_id)
            if state is not None:
                state.metrics.spec_num_draft_tokens = num_drafts
                state.metrics.spec_num_accepted_tokens = num_accepted
        for request_id, error in core_outputs.finished_requests.items():
            state = requests.get(request_id)
            if state is not None:
                state.error = error
                state.finished = True
                touched[request_id] = state
        results = []
        for state in touched.values():
            metrics = state.metrics
            if metrics.first_token_time is None and any(seq.token_ids for seq in state.seqs):
                metrics.first_token_time = now
            metrics.last_token_time = now
            if not state.finished and state.request_id in stopped_requests and _sampling_ended(state):
                state.finished = True
            if state.finished:
                results.append(self.finish(state, now))
            elif state.output_kind != RequestOutputKind.FINAL_ONLY:
                results.append(_request_output(state))
        return results, stopped

    def finish(self, state: RequestState, now: float | None = None) -> RequestOutput | PoolingRequestOutput:
        """The request's final output; the processor forgets it."""
        self.requests.pop(state.request_id, None)
        state.finished = True
        state.metrics.finished_time = now or time.time()
        self._finalize_text(state)
        return _request_output(state)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """End live requests: each one's final output, its running sequences ending with "abort"."""
        outputs = []
        for request_id in request_ids:
            state = self.requests.get(request_id)
            if state is None:
                continue
            if not state.seqs:
                state.seq(0)
            for seq in state.seqs:
                if seq.finish_reason is None:
                    seq.finish_reason = "abort"
            outputs.append(self.finish(state))
        return outputs

    # --- per sequence -------------------------------------------------------------------------

    def _apply(self, state: RequestState, output: EngineCoreOutput) -> bool:
        """One sequence's news; whether a stop string ended it now."""
        if output.pooling_output is not None:
            state.pooled = output.pooling_output
            return False
        seq = state.seq(output.index)  # a new one when replaced: its whole tokens, decoded afresh
        seq.token_ids += output.new_token_ids
        seq.cumulative_logprob = output.cumulative_logprob
        seq.finish_reason = output.finish_reason
        seq.stop_reason = output.stop_reason
        if output.new_logprobs is not None:
            for token_id, token_logprobs in zip(output.new_token_ids, output.new_logprobs):
                seq.logprobs.append(self._logprob_entry(token_id, token_logprobs))
        if not output.new_token_ids or self.tokenizer is None or not state.decodes_incrementally:
            return False
        params = state.sampling_params
        new_text = decode_incrementally(
            self.tokenizer, seq, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        if params.use_beam_search or not check_stop_strings(seq, len(new_text), params):
            return False
        seq.finish_reason = "stop"
        return True

    def _finalize_text(self, state: RequestState) -> None:
        """Decode a finished request's text at once when it was not decoded token by token."""
        if self.tokenizer is None or state.decodes_incrementally:
            return
        params = state.sampling_params
        for seq in state.seqs:
            num_tokens = len(seq.token_ids)
            # A stop token's own text is not part of the answer (see check_stop_strings); without
            # incremental decoding no stop string can have ended it.
            if seq.finish_reason == "stop" and not params.include_stop_str_in_output:
                num_tokens -= 1
            seq.text = decode_all(
                self.tokenizer,
                seq,
                num_tokens,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )

    def _add_prompt_logprobs(self, state: RequestState, scored: PromptLogprobsOutput) -> None:
        """Append the scored prompt positions not scored before (a prompt recomputed after
        preemption is scored again; its first scores stand)."""
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None]  # the first prompt token has no logprob
        have = len(state.prompt_logprobs)  # prompt tokens 0 .. have - 1 are scored
        for i, token_id in enumerate(scored.token_ids):
            if scored.start + 1 + i < have:
                continue
            entry = (scored.logprobs[i], scored.ranks[i], scored.top_token_ids[i], scored.top_logprobs[i])
            state.prompt_logprobs.append(self._logprob_entry(token_id, entry))

    def _logprob_entry(self, token_id: int, token_logprobs: TokenLogprobs) -> dict[int, Logprob]:
        """vLLM's format: the chosen token and the top tokens, each with its rank and text."""
        logprob, rank, top_ids, top_logprobs = token_logprobs
        entry = {token_id: Logprob(logprob, rank, self._decode(token_id))}
        for top_rank, (top_id, top_logprob) in enumerate(zip(top_ids, top_logprobs), start=1):
            if top_id not in entry:
                entry[top_id] = Logprob(top_logprob, top_rank, self._decode(top_id))
        return entry

    def _decode(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])


def _sampling_ended(state: RequestState) -> bool:
    """Whether every sequence of a sampled request ended (the last one perhaps by a stop string
    here, so the core has nothing left to report). Beam search ends when the core says so."""
    params = state.sampling_params
    if params.use_beam_search or len(state.seqs) != params.best_of:
        return False
    return all(seq.finish_reason is not None for seq in state.seqs)


def _request_output(state: RequestState) -> RequestOutput | PoolingRequestOutput:
    if state.pooling_params is not None:
        return _pooling_request_output(state)
    # Sequences join in index order (forks are made in it; beam search sends its own in order).
    seqs = state.seqs
    params = state.sampling_params
    if state.finished and len(seqs) > params.n and "error" not in [seq.finish_reason for seq in seqs]:
        # best_of > n: the n best sequences, best first (beam search sends its hypotheses ranked
        # by length-penalised score; sampling ranks by cumulative logprob).
        if not params.use_beam_search:
            seqs = sorted(seqs, key=lambda seq: seq.cumulative_logprob, reverse=True)
        return _build(state, seqs[: params.n], renumber=True)
    return _build(state, seqs, renumber=False)


def _pooling_request_output(state: RequestState) -> PoolingRequestOutput:
    """A pooling request's output: its embedding (empty when it ended without one: aborted)."""
    assert state.pooling_params is not None
    data = torch.empty(0) if state.pooled is None else embedding_head(state.pooled, state.pooling_params)
    return PoolingRequestOutput(
        state.request_id,
        PoolingOutput(data),
        state.prompt_token_ids,
        state.finished,
        state.metrics,
        state.error,
    )


def _build(state: RequestState, seqs: list[SequenceState], renumber: bool) -> RequestOutput:
    params = state.sampling_params
    # Beam search re-chooses whole sequences every step: they have no delta to send.
    delta = state.output_kind == RequestOutputKind.DELTA and not params.use_beam_search
    holdback = 0 if state.finished else state.holdback
    with_logprobs = params.logprobs is not None
    outputs = []
    for position, seq in enumerate(seqs):
        text = seq.text
        if holdback:
            text = text[: max(len(text) - holdback, 0)]
        token_ids, logprobs = seq.token_ids, seq.logprobs
        if delta:
            if seq.sent_finished or (
                len(seq.token_ids) == seq.num_sent_tokens
                and len(text) == seq.num_sent_chars
                and not seq.finish_reason
            ):
                continue  # nothing new
            text, seq.num_sent_chars = text[seq.num_sent_chars :], len(text)
            token_ids, logprobs = token_ids[seq.num_sent_tokens :], logprobs[seq.num_sent_tokens :]
            seq.num_sent_tokens = len(seq.token_ids)
            seq.sent_finished = seq.finish_reason is not None
        outputs.append(
            CompletionOutput(
                index=position if renumber else seq.index,
                text=text,
                token_ids=list(token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(logprobs) if with_logprobs else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
        )
    prompt_logprobs = state.prompt_logprobs
    if delta and prompt_logprobs is not None:
        prompt_logprobs, state.num_sent_prompt_logprobs = (
            prompt_logprobs[state.num_sent_prompt_logprobs :],
            len(prompt_logprobs),
        )
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        prompt_logprobs=prompt_logprobs,
        outputs=outputs,
        finished=state.finished,
        metrics=state.metrics,
        error=state.error,
    )
