"""The logits-constraint seam: what restricts a step's logits, request by request, before the
sampler draws from them.

Every kind implements ``LogitsConstraint``'s two hooks (vLLM's v1 logits processors have one,
``apply``; the second is for work that overlaps the device's):

- ``before_sampling(logits, rows)``: edit the rows' logits in place, or return a token bitmask
  (``structured_output/bitmask.py``) for the sampler to apply; its fused pass on the GPU reads the
  bitmask where it lies, without a pass of its own over the logits.
- ``after_launch(samples, requests)``: the step's sampler is launched and its samples are on
  their way to the host; a grammar starts making its next masks from them there.

allowed_token_ids, logit_bias and bad_words edit the logits (the pure functions of
``logits_processors.py``); structured outputs' grammars give the bitmask
(``worker/request_logits.py``, which keeps their state per request). ``LogitsConstraints`` runs
them in that order, the one call a step makes on each side of the sampler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedllm.sample.logits_processors import apply_allowed_token_ids, apply_bad_words, apply_logit_bias
from pagedllm.sampling_params import SamplingParams


@dataclass
class ConstraintRows:
    """A step's sample rows as constraints read them: one per sample drawn, in the logits' order.

    Attributes:
        req_ids: each row's request.
        params: each row's sampling parameters.
        output_token_ids: ``output_token_ids(i, start)`` is row i's generated tokens from index
            ``start`` on (read only as far as needed: a grammar wants the tokens since its last
            step, not the whole output).
        num_output_tokens: how many tokens each row has generated.
    """

    req_ids: list[int]
    params: list[SamplingParams]
    output_token_ids: Callable[[int, int], list[int]]
    num_output_tokens: Sequence[int]


def has_logits_processors(params: SamplingParams) -> bool:
    """Whether a request has any constraint (a row the seam must see)."""
    return bool(
        params.allowed_token_ids
        or params.logit_bias
        or params.bad_words_token_ids
        or params.structured_outputs
    )


# (req_id, output index of the sample, sample row): the first sample of a request this step.
SampledRequest = tuple[int, int, int]


class LogitsConstraint(Protocol):
    def before_sampling(self, logits: torch.Tensor, rows: ConstraintRows) -> torch.Tensor | None:
        """Restrict ``logits`` [num_rows, vocab_size]: in place, or by returning a token bitmask
        [num_rows, ceil(vocab_size / 32)] int32 on the host for the sampler to apply; None:
        nothing left to apply."""
        ...

    def after_launch(self, samples: torch.Tensor, requests: Sequence[SampledRequest]) -> None:
        """The sampler is launched. samples: the step's sampled ids on the host (int64; on CUDA
        -1 until their copy lands); requests: the first sample of each request with a
        constraint."""
        ...


class _EditsLogits:
    # The kinds that act on the logits alone: nothing to do once the sampler is launched.
    def after_launch(self, samples: torch.Tensor, requests: Sequence[SampledRequest]) -> None:
        pass


class AllowedTokenIds(_EditsLogits):
    """``allowed_token_ids``: every other token of the row is -inf."""

    def before_sampling(self, logits: torch.Tensor, rows: ConstraintRows) -> None:
        if any(p.allowed_token_ids for p in rows.params):
            apply_allowed_token_ids(logits, [p.allowed_token_ids for p in rows.params])


class LogitBias(_EditsLogits):
    """``logit_bias``: each row's ``{token_id: bias}`` added to its logits."""

    def before_sampling(self, logits: torch.Tensor, rows: ConstraintRows) -> None:
        if any(p.logit_bias for p in rows.params):
            apply_logit_bias(logits, [p.logit_bias for p in rows.params])


class BadWords(_EditsLogits):
    """``bad_words``: the token that would complete a bad word is -inf (its past is the row's
    output, read only for rows with bad words)."""

    def before_sampling(self, logits: torch.Tensor, rows: ConstraintRows) -> None:
        bad_words = [p.bad_words_token_ids for p in rows.params]
        if any(bad_words):
            past = [rows.output_token_ids(i, 0) if words else () for i, words in enumerate(bad_words)]
            apply_bad_words(logits, bad_words, past)


class LogitsConstraints:
    """Constraints applied in order, as one: the logits-editing kinds first, then the one (a
    grammar) that may give a bitmask, which masks what they leave.

    Args:
        constraints: at most one of them returns a bitmask.
    """

    def __init__(self, constraints: Sequence[LogitsConstraint]) -> None:
        self.constraints = list(constraints)

    def before_sampling(self, logits: torch.Tensor, rows: ConstraintRows) -> torch.Tensor | None:
        bitmask = None
        for constraint in self.constraints:
            mask = constraint.before_sampling(logits, rows)
            if mask is not None:
                assert bitmask is None, "two constraints gave a bitmask"
                bitmask = mask
        return bitmask

    def after_launch(self, samples: torch.Tensor, requests: Sequence[SampledRequest]) -> None:
        for constraint in self.constraints:
            constraint.after_launch(samples, requests)
