"""What the engine does with a step's samples: extend sequences, fork, record logprobs,
detokenize, check stop conditions, free what finished."""

from __future__ import annotations

import itertools

from pagedllm.core.scheduler import Scheduler
from pagedllm.detokenizer import decode_all, decode_incrementally
from pagedllm.engine.beam_search import BeamSearch
from pagedllm.engine.stop_checker import StopChecker
from pagedllm.layers.sampler import SequenceSample
from pagedllm.sequence import Logprob, Sequence, SequenceGroup, SequenceStatus
from pagedllm.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer | None,
        stop_checker: StopChecker,
        seq_counter: itertools.count,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.stop_checker = stop_checker
        self._seq_counter = seq_counter
        self.beam_search = BeamSearch(
            fork=self._fork,
            free=scheduler.free_seq,
            new_seq_id=lambda: next(seq_counter),
            ends=self._status_if_appended,
            append=self._append,
        )

    def process(
        self,
        seq_group: SequenceGroup,
        samples: list[SequenceSample] | None,
        prompt_logprobs: list[SequenceSample] | None,
    ) -> None:
        """Apply one step's results to a request."""
        if prompt_logprobs:
            self._add_prompt_logprobs(seq_group, prompt_logprobs)
        if not samples:
            return
        params = seq_group.sampling_params
        if params.use_beam_search:
            num_eos = 0 if params.ignore_eos else len(self.stop_checker.eos_token_ids)
            # The most tokens a beam can reach: it bounds how much a live beam can still improve.
            room = self.stop_checker.max_model_len - len(seq_group.prompt_token_ids)
            max_new_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
            self.beam_search.step(seq_group, samples, num_eos, max_new_tokens)
            return
        if seq_group.is_forked:
            seqs_by_id = {seq.seq_id: seq for seq in seq_group.seqs}
            pairs = [(seqs_by_id[sample.parent_seq_id], sample) for sample in samples]
        else:
            # The first sample of a best_of > 1 request: fork the prompt's sequence, sharing its
            # blocks, once per extra sample. The parent takes the first sample.
            parent = seq_group.seqs[0]
            for index in range(1, len(samples)):
                self._fork(seq_group, parent).output_index = index
            pairs = list(zip(seq_group.seqs, samples))
        for seq, sample in pairs:
            new_char_count = self._append(seq_group, seq, sample)
            self.stop_checker.check(seq, new_char_count, params)
            if seq.is_finished():
                self.scheduler.free_seq(seq)

    def _fork(self, seq_group: SequenceGroup, parent: Sequence) -> Sequence:
        child = parent.fork(next(self._seq_counter))
        self.scheduler.fork_seq(parent, child)
        seq_group.add(child)
        return child

    def _status_if_appended(
        self, seq_group: SequenceGroup, seq: Sequence, token_id: int
    ) -> SequenceStatus | None:
        return self.stop_checker.status_if_appended(seq, token_id, seq_group.sampling_params)

    def _append(self, seq_group: SequenceGroup, seq: Sequence, sample: SequenceSample) -> int:
        """Append the token (and its logprobs, when asked for); return the characters it added."""
        params = seq_group.sampling_params
        seq.append_token_id(sample.token_id, sample.logprob)
        if params.logprobs is not None:
            seq.output_logprobs.append(self._logprob_entry(sample))
        if self.tokenizer is None or not _decodes_incrementally(seq_group):
            return 0
        new_text = decode_incrementally(
            self.tokenizer, seq, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        return len(new_text)

    def finalize_text(self, seq_group: SequenceGroup) -> None:
        """Decode a finished request's text at once when it was not decoded token by token."""
        if self.tokenizer is None or _decodes_incrementally(seq_group):
            return
        params = seq_group.sampling_params
        for seq in seq_group.seqs:
            num_tokens = seq.num_output_tokens
            # A stop token's own text is not part of the answer (see StopChecker.check); without
            # incremental decoding no stop string can have ended it.
            stopped_by_token = seq.status == SequenceStatus.FINISHED_STOPPED
            if stopped_by_token and not params.include_stop_str_in_output:
                num_tokens -= 1
            seq.output_text = decode_all(
                self.tokenizer,
                seq,
                num_tokens,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )

    def _add_prompt_logprobs(self, seq_group: SequenceGroup, scored: list[SequenceSample]) -> None:
        if seq_group.prompt_logprobs is None:
            seq_group.prompt_logprobs = [None]  # the first prompt token has no logprob
        seq_group.prompt_logprobs.extend(self._logprob_entry(sample) for sample in scored)

    def _logprob_entry(self, sample: SequenceSample) -> dict[int, Logprob]:
        """vLLM's format: the chosen token and the top tokens, each with its rank and text."""
        entry = {sample.token_id: Logprob(sample.logprob, sample.rank, self._decode(sample.token_id))}
        top = zip(sample.top_token_ids or [], sample.top_logprobs or [])
        for rank, (token_id, logprob) in enumerate(top, start=1):
            if token_id not in entry:
                entry[token_id] = Logprob(logprob, rank, self._decode(token_id))
        return entry

    def _decode(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])


def _decodes_incrementally(seq_group: SequenceGroup) -> bool:
    # Streamed text is needed every step; stop strings are matched against the text as it grows.
    return seq_group.stream or bool(seq_group.sampling_params.stop)
