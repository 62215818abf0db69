"""Turns logits into next tokens: penalties, greedy, temperature, top-k, top-p, min-p, seeds,
the logprobs users ask for, and beam search's candidates.

Each row of the logits is one sample to draw (the worker repeats a request's row when it draws
``best_of`` first tokens from its prompt); every parameter is a per-row tensor of
``SamplingMetadata``. Everything stays on the device: the results go back to the host in one
copy, which the worker may leave in flight while the next step is scheduled.

Sampling uses the exponential race: with ``q ~ Exp(1)`` i.i.d. per token, ``argmax(p / q)`` is
distributed as ``p``; taken in logits, ``argmax(x / T - log q)`` (the Gumbel-max trick), it needs
no softmax and no cumulative sums, and a seeded row just draws its ``q`` from its own generator,
so its tokens do not depend on the rest of the batch. On the GPU the last pass (race or argmax,
and the chosen token's logprob) is one split reduction over each row
(kernels/triton/sampling.py). The CPU draws each row's token by inverting its CDF at one uniform
draw instead: the same distribution, without a vocabulary's worth of exponential draws.

Logprobs are those of the model (log_softmax of the raw logits), whatever penalties and
truncation did to the sampling distribution, as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.kernels.cpu.build import available as cpu_kernels_available
from pagedllm.kernels.cpu.ops import argmax_logsumexp
from pagedllm.layers.utils import use_triton
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.penalties import apply_penalties, ban_tokens
from pagedllm.structured_output.bitmask import apply_token_bitmask


@dataclass
class SamplerOutput:
    """On the logits' device, one entry per row."""

    token_ids: torch.Tensor  # [num_rows] int64
    logprobs: torch.Tensor  # [num_rows] float32: the chosen tokens' logprobs
    # When some row asked for top tokens: [num_rows] int64 ranks of the chosen tokens (1 = most
    # likely), [num_rows, k] the k most likely tokens and their logprobs (beam rows: penalised).
    ranks: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


class Sampler(nn.Module):
    def warm_up(self, vocab_size: int, device: torch.device) -> None:
        """Compile the GPU's fused pass for every case a step can launch."""
        if device.type == "cuda" and use_triton(torch.empty(0, device=device)):
            from pagedllm.kernels.triton.sampling import warm_up

            warm_up(vocab_size, device)

    def forward(
        self, logits: torch.Tensor, metadata: SamplingMetadata, token_bitmask: torch.Tensor | None = None
    ) -> SamplerOutput:
        """logits: [num_rows, vocab_size] float32; token_bitmask: structured outputs' grammar
        bitmask [num_rows, ceil(vocab_size / 32)] int32 on the logits' device or in pinned host
        memory (which the fused pass reads in place), or None: the tokens each row may take, as if
        its other logits were -inf (the logprobs too)."""
        # Top tokens need every logprob; otherwise only the chosen tokens' are needed, which the
        # fused pass on the GPU computes without a [rows, vocab] log_softmax, and the CPU from each
        # row's log-sum-exp (read before the bans below, which may write into the logits).
        fused = use_triton(logits) and not metadata.max_num_top_tokens
        # The fused pass reads the bitmask itself, unless a truncation must see the masked
        # logits first.
        if token_bitmask is not None and (not fused or metadata.truncates):
            apply_token_bitmask(logits, token_bitmask)
            token_bitmask = None
        row_max = logsumexp = None
        if (
            not fused
            and not metadata.max_num_top_tokens
            and logits.device.type == "cpu"
            and cpu_kernels_available()
        ):
            row_max, logsumexp = argmax_logsumexp(logits)
        logprobs = None if fused or logsumexp is not None else torch.log_softmax(logits, dim=-1)
        x = apply_penalties(logits, metadata)
        if fused and x is logits and metadata.banned_rows is not None:
            x = logits.clone()  # the bans must not reach the logits the logprobs come from
        ban_tokens(x, metadata)
        noise = inv_temperature = None
        if not metadata.all_greedy:
            x, inv_temperature = _truncate(x, metadata)
            if x.device.type != "cpu":
                noise = _exponential_noise(x, metadata)
        if fused:
            from pagedllm.kernels.triton.sampling import sample_tokens

            token_ids, chosen = sample_tokens(
                logits, x, noise, inv_temperature, metadata.greedy, bitmask=token_bitmask
            )
            return SamplerOutput(token_ids=token_ids, logprobs=chosen)
        if x.device.type == "cpu" and not metadata.all_greedy:
            token_ids = _inverse_cdf(x, inv_temperature, metadata)
        elif row_max is not None and x is logits and metadata.banned_rows is None:
            token_ids = row_max  # greedy over the logits as they came
        else:
            token_ids = _race(x, noise, inv_temperature, metadata.greedy)
        if logsumexp is not None:
            chosen = logits.gather(-1, token_ids[:, None]).squeeze(-1) - logsumexp
            return SamplerOutput(token_ids=token_ids, logprobs=chosen)
        assert logprobs is not None
        chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
        output = SamplerOutput(token_ids=token_ids, logprobs=chosen)
        if metadata.max_num_top_tokens:
            scores = _beam_scores(logprobs, metadata)
            output.top_logprobs, output.top_token_ids = scores.topk(metadata.max_num_top_tokens, dim=-1)
            output.ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
        return output


def _beam_scores(logprobs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """What top tokens are ranked by: the logprobs; for beam search rows, the logprobs with the
    penalties and min_tokens bans applied (HF's beam search applies its processors to them)."""
    if metadata.beam is None:
        return logprobs
    scores = apply_penalties(logprobs, metadata)
    if scores is logprobs:
        scores = logprobs.clone()
    ban_tokens(scores, metadata)
    return torch.where(metadata.beam[:, None], scores, logprobs)


def _truncate(logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """What the sampled rows draw from, and the inverse temperature still to apply to it.

    Top-k, top-p and min-p act on the tempered distribution, so rows are scaled first when any
    applies (inverse temperature 1 is then left); otherwise the scaling is left to the race. Greedy
    rows (temperature 1 here) keep their argmax: every truncation keeps the most likely token.
    """
    inv_temperature = 1.0 / metadata.temperature
    if not metadata.truncates:
        return logits, inv_temperature
    logits = logits * inv_temperature[:, None]
    if metadata.top_k is not None or metadata.top_p is not None:
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    return logits, torch.ones_like(inv_temperature)


def _exponential_noise(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Exp(1) noise for the race, a seeded row's from its own generator."""
    noise = torch.empty_like(logits).exponential_()
    for row, generator in metadata.generators.items():
        noise[row].exponential_(generator=generator)
    return noise


def _inverse_cdf(
    logits: torch.Tensor, inv_temperature: torch.Tensor, metadata: SamplingMetadata
) -> torch.Tensor:
    """The CPU's draw: each sampled row's token by inverting its CDF at one uniform draw (a seeded
    row's from its own generator). The same distribution as the race, ~10x faster on the CPU,
    whose exponential draws cost ~20 ns a token (34 ms for 32 rows of 49,152 tokens on two cores,
    against 3.5 ms here); the GPU keeps the race, which needs no cumulative sums."""
    token_ids = logits.argmax(dim=-1)
    probs = torch.softmax(logits * inv_temperature[:, None], dim=-1)
    cdf = probs.cumsum_(dim=-1)
    uniform = torch.rand(logits.shape[0])
    for row, generator in metadata.generators.items():
        uniform[row] = torch.rand(1, generator=generator)[0]
    # right=True: the first token whose CDF passes the draw, so a token of probability 0 (its CDF
    # equal to its predecessor's) is never chosen.
    sampled = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(-1)
    # A draw that rounds up to the whole mass falls past the end: the most likely token then.
    sampled = torch.where(sampled < logits.shape[1], sampled, token_ids)
    assert metadata.greedy is not None  # some row samples
    return torch.where(metadata.greedy, token_ids, sampled)


def _race(
    logits: torch.Tensor,
    noise: torch.Tensor | None,
    inv_temperature: torch.Tensor | None,
    greedy: torch.Tensor | None,
) -> torch.Tensor:
    """Each row's token: the argmax for greedy rows; for sampled rows the exponential race,
    ``argmax(softmax(x / T) / q) = argmax(x / T - log q)`` (no normalisation needed)."""
    token_ids = logits.argmax(dim=-1)
    if noise is None:
        return token_ids
    assert inv_temperature is not None and greedy is not None
    # Exp(1) draws can round to 0: log 0 against a banned token's -inf would be NaN, and win.
    log_noise = noise.clamp(min=torch.finfo(noise.dtype).tiny).log()
    sampled = (logits * inv_temperature[:, None] - log_noise).argmax(dim=-1)
    return torch.where(greedy, token_ids, sampled)


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


def apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Mask to -inf tokens less likely than min_p times the row's most likely one: in logit space,
    below the row's max plus log(min_p) (min_p 0: none). logits: [rows, vocab], tempered."""
    threshold = logits.max(dim=-1, keepdim=True).values + torch.log(min_ps)[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))
