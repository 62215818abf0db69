"""Turns logits into next tokens: penalties, greedy, temperature, top-k, top-p, min-p, seeds,
the logprobs users ask for, and beam search's candidates.

Each row of the logits is one sample to draw: the model runner repeats a sequence's row when a
request draws ``best_of`` first tokens from its prompt. Work is batched over rows on the device;
the only per-row Python is for rows with their own seeded generator, and the host syncs are the
few ``tolist`` calls of the results at the end.

Sampling uses the exponential race: with ``q ~ Exp(1)`` i.i.d. per token,
``argmax(p / q)`` is distributed as ``p``. It needs no cumulative sums, and a seeded row just
draws its ``q`` from its own generator, so its tokens do not depend on the rest of the batch.

Logprobs are those of the model (log_softmax of the raw logits), whatever penalties and
truncation did to the sampling distribution, as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.penalties import apply_penalties
from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplingGroup:
    """One request's rows in this step's logits."""

    request_id: str
    params: SamplingParams
    # The sequence each row samples for (a sequence appears best_of times on its first sample).
    seq_ids: list[int]
    # Number of tokens each row's sequence has generated so far (for min_tokens).
    num_output_tokens: list[int]
    # Tokens that would end the request (EOS unless ignore_eos, and stop_token_ids): banned from
    # rows that have not yet generated min_tokens.
    stop_token_ids: list[int]
    generator: torch.Generator | None = None
    # Each row's generated tokens, when presence/frequency/repetition penalties are on.
    output_token_ids: list[list[int]] | None = None
    # The prompt, when the repetition penalty is on (it counts prompt tokens too).
    prompt_token_ids: list[int] | None = None
    # How many of each row's most likely tokens to return: max(logprobs, beam candidates).
    num_top_tokens: int = 0


@dataclass
class SequenceSample:
    """One drawn token: the sequence it extends, the token, and its logprob under the model.

    When the request asked for logprobs (or runs beam search), also the token's 1-based rank and
    the row's ``num_top_tokens`` most likely tokens with their logprobs, best first.
    """

    parent_seq_id: int
    token_id: int
    logprob: float
    rank: int | None = None
    top_token_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


# request_id -> that request's samples, in row order.
SamplerOutput = dict[str, list[SequenceSample]]


@dataclass
class SamplingTensors:
    """Per-row parameters, on the logits' device. Rows are the groups' rows, in group order."""

    temperatures: torch.Tensor  # [num_rows] float32, 1.0 for greedy rows
    top_ks: torch.Tensor  # [num_rows] int64, vocab_size when disabled
    top_ps: torch.Tensor  # [num_rows] float32
    min_ps: torch.Tensor  # [num_rows] float32
    greedy: torch.Tensor  # [num_rows] bool
    do_top_k: bool
    do_top_p: bool
    do_min_p: bool

    @classmethod
    def from_groups(
        cls, groups: list[SamplingGroup], vocab_size: int, device: torch.device
    ) -> SamplingTensors:
        temperatures, top_ks, top_ps, min_ps, greedy = [], [], [], [], []
        for group in groups:
            p = group.params
            n = len(group.seq_ids)
            # Beam search ranks candidates by logprob: it never draws, like greedy.
            is_greedy = p.is_greedy or p.use_beam_search
            temperatures += [1.0 if is_greedy else p.temperature] * n
            top_ks += [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size)] * n
            top_ps += [p.top_p] * n
            min_ps += [p.min_p] * n
            greedy += [is_greedy] * n

        def to(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperatures=to(temperatures, torch.float32),
            top_ks=to(top_ks, torch.int64),
            top_ps=to(top_ps, torch.float32),
            min_ps=to(min_ps, torch.float32),
            greedy=to(greedy, torch.bool),
            do_top_k=any(k < vocab_size for k in top_ks),
            do_top_p=any(p < 1.0 for p in top_ps),
            do_min_p=any(p > 0.0 for p in min_ps),
        )


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, groups: list[SamplingGroup]) -> SamplerOutput:
        """logits: [num_rows, vocab_size] float32, one row per SamplingGroup row."""
        logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_penalties(logits, groups)
        _ban_stop_tokens_before_min_tokens(logits, groups)
        token_ids = logits.argmax(dim=-1)
        if not all(g.params.is_greedy or g.params.use_beam_search for g in groups):
            tensors = SamplingTensors.from_groups(groups, logits.shape[-1], logits.device)
            sampled = _sample_random(logits, tensors, groups)
            token_ids = torch.where(tensors.greedy, token_ids, sampled)
        chosen_logprobs = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
        top = _top_tokens(logprobs, chosen_logprobs, [g for g in groups if not g.params.use_beam_search])
        beam_top = _top_tokens(
            _beam_scores(logprobs, groups), chosen_logprobs, [g for g in groups if g.params.use_beam_search]
        )
        # The step's host syncs: the tokens must reach the scheduler.
        token_list = token_ids.tolist()
        logprob_list = chosen_logprobs.tolist()
        output: SamplerOutput = {}
        row = 0
        for group in groups:
            group_top = beam_top if group.params.use_beam_search else top
            samples = []
            for i, seq_id in enumerate(group.seq_ids):
                sample = SequenceSample(seq_id, token_list[row + i], logprob_list[row + i])
                if _wants_top(group):
                    sample.rank, sample.top_token_ids, sample.top_logprobs = group_top.row(
                        row + i, group.num_top_tokens
                    )
                samples.append(sample)
            output[group.request_id] = samples
            row += len(group.seq_ids)
        return output


class TopTokens:
    """The rows' most likely tokens and the chosen tokens' ranks, on the host."""

    def __init__(self, ranks: list[int], token_ids: list[list[int]], logprobs: list[list[float]]) -> None:
        self.ranks = ranks
        self.token_ids = token_ids
        self.logprobs = logprobs

    def row(self, row: int, k: int) -> tuple[int, list[int], list[float]]:
        return self.ranks[row], self.token_ids[row][:k], self.logprobs[row][:k]


def _top_tokens(
    logprobs: torch.Tensor, chosen_logprobs: torch.Tensor, groups: list[SamplingGroup]
) -> TopTokens | None:
    """The top ``max(num_top_tokens)`` tokens over ``groups`` for every row (rows are cut to what
    they asked for on the host), and the rank of each chosen token."""
    if not any(_wants_top(group) for group in groups):
        return None
    return top_logprobs(logprobs, chosen_logprobs, max(1, *(group.num_top_tokens for group in groups)))


def _wants_top(group: SamplingGroup) -> bool:
    # logprobs=0 still reports the chosen token's rank.
    return group.num_top_tokens > 0 or group.params.logprobs is not None


def _beam_scores(logprobs: torch.Tensor, groups: list[SamplingGroup]) -> torch.Tensor:
    """What beam search ranks candidates by: the logprobs, then the penalties and min_tokens bans,
    applied to the logprobs (not the logits) as HF's beam search applies its processors."""
    if not any(g.params.use_beam_search for g in groups):
        return logprobs
    scores = apply_penalties(logprobs, groups)
    if scores is logprobs:
        scores = logprobs.clone()
    _ban_stop_tokens_before_min_tokens(scores, groups)
    return scores


def top_logprobs(logprobs: torch.Tensor, chosen_logprobs: torch.Tensor, k: int) -> TopTokens:
    """logprobs: [rows, vocab]; chosen_logprobs: [rows]. Rank 1 is the most likely token."""
    values, indices = logprobs.topk(k, dim=-1)
    ranks = (logprobs > chosen_logprobs[:, None]).sum(dim=-1) + 1
    return TopTokens(ranks.tolist(), indices.tolist(), values.tolist())


def _ban_stop_tokens_before_min_tokens(logits: torch.Tensor, groups: list[SamplingGroup]) -> None:
    """Rows that have not yet generated min_tokens cannot pick EOS or a stop token."""
    rows: list[int] = []
    cols: list[int] = []
    row = 0
    for group in groups:
        for num_output in group.num_output_tokens:
            if num_output < group.params.min_tokens:
                rows += [row] * len(group.stop_token_ids)
                cols += group.stop_token_ids
            row += 1
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")


def _sample_random(logits: torch.Tensor, t: SamplingTensors, groups: list[SamplingGroup]) -> torch.Tensor:
    logits = logits / t.temperatures[:, None]
    if t.do_top_k or t.do_top_p:
        logits = apply_top_k_top_p(logits, t.top_ks if t.do_top_k else None, t.top_ps if t.do_top_p else None)
    probs = torch.softmax(logits, dim=-1)
    if t.do_min_p:
        probs = apply_min_p(probs, t.min_ps)
    q = torch.empty_like(probs).exponential_()
    row = 0
    for group in groups:
        num_rows = len(group.seq_ids)
        if group.generator is not None:
            q[row : row + num_rows].exponential_(generator=group.generator)
        row += num_rows
    return (probs / q).argmax(dim=-1)


def apply_top_k_top_p(
    logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None
) -> torch.Tensor:
    """Mask to -inf every token outside each row's top k and outside its top-p nucleus.

    logits: [num_rows, vocab]; top_ks: [num_rows] int64 (vocab = off); top_ps: [num_rows].
    """
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[-1]
    if top_ks is not None:
        # The k-th largest value, and everything below it, goes (ties with it stay).
        kth = sorted_logits.gather(-1, (vocab_size - top_ks)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_ps is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= 1.0 - top_ps[:, None]
        outside[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Zero tokens less likely than min_p times the row's most likely one. probs: [rows, vocab]."""
    threshold = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
    return probs.masked_fill(probs < threshold, 0.0)
