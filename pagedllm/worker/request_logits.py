"""The per-request logits processors of a step's sample rows: allowed_token_ids, logit_bias,
bad_words and structured outputs' grammar bitmask, applied before the sampler.

Grammar state lives here, one matcher per sequence (a forked sequence gets its own), caught up
each step with the tokens its sequence generated since the last; it is dropped when the request
finishes. Compilation happened when the request was validated (``compiled_grammar``).
"""

from __future__ import annotations

import logging

import torch

from pagedllm.layers.sampler import SamplingGroup
from pagedllm.sample.logits_processors import apply_allowed_token_ids, apply_bad_words, apply_logit_bias
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import StructuredOutputGrammar, allocate_token_bitmask, apply_token_bitmask

logger = logging.getLogger(__name__)


def has_logits_processors(params: SamplingParams) -> bool:
    return bool(
        params.allowed_token_ids
        or params.logit_bias
        or params.bad_words_token_ids
        or params.structured_outputs
    )


class RequestLogitsProcessors:
    def __init__(self) -> None:
        # request id -> seq id -> that sequence's grammar.
        self._grammars: dict[str, dict[int, StructuredOutputGrammar]] = {}

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._grammars.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, groups: list[SamplingGroup]) -> None:
        """logits: [num_rows, vocab_size], the groups' rows in order; edited in place."""
        if not any(has_logits_processors(group.params) for group in groups):
            return
        allowed, biases, bad_words, past, grammars = [], [], [], [], []
        for group in groups:
            params = group.params
            outputs = group.output_token_ids or [[] for _ in group.seq_ids]
            for seq_id, output_token_ids in zip(group.seq_ids, outputs):
                allowed.append(params.allowed_token_ids)
                biases.append(params.logit_bias)
                bad_words.append(params.bad_words_token_ids)
                past.append(output_token_ids)
                grammars.append(self._grammar(group, seq_id, output_token_ids))
        apply_allowed_token_ids(logits, allowed)
        apply_logit_bias(logits, biases)
        apply_bad_words(logits, bad_words, past)
        if any(grammar is not None for grammar in grammars):
            bitmask = allocate_token_bitmask(len(grammars), logits.shape[1])
            for row, grammar in enumerate(grammars):
                if grammar is not None and not grammar.is_terminated():
                    grammar.fill_bitmask(bitmask, row)
            apply_token_bitmask(logits, bitmask)

    def _grammar(
        self, group: SamplingGroup, seq_id: int, output_token_ids: list[int]
    ) -> StructuredOutputGrammar | None:
        structured = group.params.structured_outputs
        if structured is None or structured.compiled_grammar is None:
            return None
        grammars = self._grammars.setdefault(group.request_id, {})
        grammar = grammars.get(seq_id)
        if grammar is None:
            grammar = grammars[seq_id] = StructuredOutputGrammar(structured.compiled_grammar)
        new_tokens = output_token_ids[grammar.num_processed_tokens :]
        if new_tokens and not grammar.accept_tokens(new_tokens):
            # Only a token the mask did not allow (e.g. EOS forced by max_tokens) gets here.
            logger.warning("request %s: output left its grammar; no longer constrained", group.request_id)
            grammars[seq_id] = None
            return None
        return grammar
