"""What the engine does with each new token: logprobs in vLLM's format, incremental (or one-shot)
detokenization, stop strings (the core stops requests on tokens and lengths itself)."""

from __future__ import annotations

from pagedllm.core.request import Logprob, Request, RequestState, RequestStatus
from pagedllm.detokenizer import decode_all, decode_incrementally
from pagedllm.engine.stop_checker import check_stop_strings
from pagedllm.step_io import ModelRunnerOutput, PromptLogprobsOutput
from pagedllm.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def process_token(
        self, state: RequestState, request: Request, runner_output: ModelRunnerOutput, row: int
    ) -> RequestStatus | None:
        """Record the logprobs and text of the request's next unprocessed token (sampled in
        ``row``: a step that verified drafts appends several, processed in order); return
        FINISHED_STOPPED when its text completes a stop string."""
        params = state.sampling_params
        request.num_processed_output_tokens += 1
        if params.logprobs is not None:
            rank, top_ids, top_logprobs = runner_output.top_tokens[row]
            token_id = runner_output.sampled_token_ids[row]
            logprob = runner_output.logprobs[row]
            request.output_logprobs.append(
                self._logprob_entry(token_id, logprob, rank, top_ids, top_logprobs)
            )
        new_char_count = self.detokenize(
            state, request, request.num_prompt_tokens + request.num_processed_output_tokens
        )
        return check_stop_strings(request, new_char_count, params)

    def detokenize(self, state: RequestState, request: Request, end: int | None = None) -> int:
        """Extend the request's text by its tokens up to ``end`` (default: all) when it is decoded
        token by token; return the characters added."""
        if self.tokenizer is None or not _decodes_incrementally(state):
            return 0
        params = state.sampling_params
        new_text = decode_incrementally(
            self.tokenizer, request, params.skip_special_tokens, params.spaces_between_special_tokens, end
        )
        return len(new_text)

    def finalize_text(self, state: RequestState) -> None:
        """Decode a finished request's text at once when it was not decoded token by token."""
        if self.tokenizer is None or _decodes_incrementally(state):
            return
        params = state.sampling_params
        for seq in state.seqs:
            num_tokens = seq.num_output_tokens
            # A stop token's own text is not part of the answer (see check_stop_strings); without
            # incremental decoding no stop string can have ended it.
            stopped_by_token = seq.status == RequestStatus.FINISHED_STOPPED
            if stopped_by_token and not params.include_stop_str_in_output:
                num_tokens -= 1
            seq.output_text = decode_all(
                self.tokenizer,
                seq,
                num_tokens,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )

    def add_prompt_logprobs(self, state: RequestState, scored: PromptLogprobsOutput) -> None:
        """Append the scored prompt positions not scored before (a prompt recomputed after
        preemption is scored again; its first scores stand)."""
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None]  # the first prompt token has no logprob
        have = len(state.prompt_logprobs)  # prompt tokens 0 .. have - 1 are scored
        for i, token_id in enumerate(scored.token_ids):
            if scored.start + 1 + i < have:
                continue
            state.prompt_logprobs.append(
                self._logprob_entry(
                    token_id,
                    scored.logprobs[i],
                    scored.ranks[i],
                    scored.top_token_ids[i],
                    scored.top_logprobs[i],
                )
            )

    def _logprob_entry(
        self, token_id: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float]
    ) -> dict[int, Logprob]:
        """vLLM's format: the chosen token and the top tokens, each with its rank and text."""
        entry = {token_id: Logprob(logprob, rank, self._decode(token_id))}
        for top_rank, (top_id, top_logprob) in enumerate(zip(top_ids, top_logprobs), start=1):
            if top_id not in entry:
                entry[top_id] = Logprob(top_logprob, top_rank, self._decode(top_id))
        return entry

    def _decode(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])


def _decodes_incrementally(state: RequestState) -> bool:
    # Streamed text is needed every step; stop strings are matched against the text as it grows.
    return state.stream or bool(state.sampling_params.stop)
