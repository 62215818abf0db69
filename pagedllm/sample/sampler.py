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

import functools
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.kernels.cpu.build import available as cpu_kernels_available
from pagedllm.kernels.cpu.ops import argmax_logsumexp
from pagedllm.platform import platform_for
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.penalties import penalised
from pagedllm.structured_output.bitmask import token_bitmask_applier


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
    """Args:
    device: where the logits will be. How a step is sampled is chosen here, once for the device:
        with CUDA and Triton, the fused last pass (kernels/triton/sampling.py), which reads the
        grammar bitmask itself and computes only the chosen tokens' logprobs; on the CPU with
        pagedllm's kernels, each row's argmax and log-sum-exp in one pass (kernels/cpu); else
        torch's log_softmax. The CPU draws by inverting each row's CDF, other devices by the
        exponential race.
    batch_invariant: a row's token and logprobs independent of the other rows, and equal, bit
        for bit, to what a later pass over prompt + output scores (``log_softmax``, which prompt
        logprobs use). With Triton, the fused pass with one chunk size for every batch, and
        ``log_softmax`` the logits minus the logsumexp it subtracts; else torch's log_softmax,
        which reduces each row in one pass whatever the number of rows.
    """

    def __init__(self, device: torch.device | str = "cpu", batch_invariant: bool = False) -> None:
        super().__init__()
        self.device = torch.device(device)
        on_cpu = self.device.type == "cpu"
        self._draw = _draw_by_inverse_cdf if on_cpu else _draw_by_race
        self._apply_token_bitmask = token_bitmask_applier(self.device)
        self.batch_invariant = batch_invariant
        # Every logprob of a row (top tokens, prompt logprobs): [rows, vocab] -> [rows, vocab].
        self.log_softmax = _log_softmax
        # A batch where some row asks for top tokens, which need every logprob.
        self._sample_with_top_tokens = self._torch_pass
        if platform_for(self.device).triton:
            from pagedllm.kernels.triton import sampling

            self._sample_tokens = functools.partial(sampling.sample_tokens, invariant=batch_invariant)
            self._sample = self._fused_pass
            if batch_invariant:
                # The top tokens too come from the fused pass's logsumexp, and the batch's asking
                # for them changes nothing else: a row's token is still the fused pass's.
                invariant_logsumexp = functools.partial(sampling.logsumexp, invariant=True)
                self.log_softmax = lambda logits: logits - invariant_logsumexp(logits)[:, None]
                self._sample_with_top_tokens = self._fused_pass_with_top_tokens
        elif batch_invariant:
            self._sample = self._torch_pass
        elif on_cpu and cpu_kernels_available():
            self._sample = self._cpu_kernel_pass
        else:
            self._sample = self._torch_pass

    def warm_up(self, vocab_size: int, device: torch.device) -> None:
        """Compile the GPU's fused pass for every case a step can launch."""
        if self._sample == self._fused_pass:
            from pagedllm.kernels.triton.sampling import warm_up

            warm_up(vocab_size, device, invariant=self.batch_invariant)

    def forward(
        self, logits: torch.Tensor, metadata: SamplingMetadata, token_bitmask: torch.Tensor | None = None
    ) -> SamplerOutput:
        """logits: [num_rows, vocab_size] float32; token_bitmask: structured outputs' grammar
        bitmask [num_rows, ceil(vocab_size / 32)] int32 on the logits' device or in pinned host
        memory (which the fused pass reads in place), or None: the tokens each row may take, as if
        its other logits were -inf (the logprobs too)."""
        # Chosen per step, because batches differ here: top tokens need every logprob, which
        # the fused and CPU passes do not compute (they compute the chosen tokens' alone).
        if metadata.max_num_top_tokens:
            return self._sample_with_top_tokens(logits, metadata, token_bitmask)
        return self._sample(logits, metadata, token_bitmask)

    def _fused_pass(
        self, logits: torch.Tensor, metadata: SamplingMetadata, token_bitmask: torch.Tensor | None
    ) -> SamplerOutput:
        """Penalties, bans and truncation in torch, then one kernel for the draw (or argmax) and
        the chosen tokens' logprobs, with no [rows, vocab] log_softmax."""
        # The kernel reads the bitmask itself, unless a truncation must see the masked logits
        # first: per step, since only then does some row truncate.
        if token_bitmask is not None and metadata.truncates:
            self._apply_token_bitmask(logits, token_bitmask)
            token_bitmask = None
        # The bans must not reach the logits the logprobs come from.
        x = penalised(logits, metadata, copy=True)
        noise = inv_temperature = None
        if not metadata.all_greedy:
            x, inv_temperature = _truncate(x, metadata)
            noise = _exponential_noise(x, metadata)
        token_ids, chosen = self._sample_tokens(
            logits, x, noise, inv_temperature, metadata.greedy, bitmask=token_bitmask
        )
        return SamplerOutput(token_ids=token_ids, logprobs=chosen)

    def _fused_pass_with_top_tokens(
        self, logits: torch.Tensor, metadata: SamplingMetadata, token_bitmask: torch.Tensor | None
    ) -> SamplerOutput:
        """The fused pass's tokens and logprobs, and the top tokens from ``log_softmax``."""
        if token_bitmask is not None:  # the top tokens' logprobs are the masked ones too
            self._apply_token_bitmask(logits, token_bitmask)
        output = self._fused_pass(logits, metadata, None)
        _add_top_tokens(output, self.log_softmax(logits), metadata)
        return output

    def _cpu_kernel_pass(
        self, logits: torch.Tensor, metadata: SamplingMetadata, token_bitmask: torch.Tensor | None
    ) -> SamplerOutput:
        """The chosen tokens' logprobs from each row's log-sum-exp, which one kernel pass reads
        with the row's argmax (the greedy token when nothing edits the logits)."""
        if token_bitmask is not None:
            self._apply_token_bitmask(logits, token_bitmask)
        # Read before the bans below, which may write into the logits.
        row_max, logsumexp = argmax_logsumexp(logits)
        x = penalised(logits, metadata, copy=False)
        if metadata.all_greedy and x is logits and metadata.banned_rows is None:
            token_ids = row_max  # greedy over the logits as they came
        else:
            token_ids = self._draw(x, metadata)
        chosen = logits.gather(-1, token_ids[:, None]).squeeze(-1) - logsumexp
        return SamplerOutput(token_ids=token_ids, logprobs=chosen)

    def _torch_pass(
        self, logits: torch.Tensor, metadata: SamplingMetadata, token_bitmask: torch.Tensor | None
    ) -> SamplerOutput:
        """Every logprob (a log_softmax over the rows), the draw, and the top tokens asked for."""
        if token_bitmask is not None:
            self._apply_token_bitmask(logits, token_bitmask)
        logprobs = self.log_softmax(logits)
        token_ids = self._draw(penalised(logits, metadata, copy=False), metadata)
        chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
        output = SamplerOutput(token_ids=token_ids, logprobs=chosen)
        if metadata.max_num_top_tokens:
            _add_top_tokens(output, logprobs, metadata)
        return output


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1)


def _add_top_tokens(output: SamplerOutput, logprobs: torch.Tensor, metadata: SamplingMetadata) -> None:
    """The ``metadata.max_num_top_tokens`` best tokens of each row by ``logprobs`` (beam rows: by
    their penalised scores), and the chosen tokens' ranks."""
    scores = _beam_scores(logprobs, metadata)
    output.top_logprobs, output.top_token_ids = scores.topk(metadata.max_num_top_tokens, dim=-1)
    output.ranks = (logprobs > output.logprobs[:, None]).sum(dim=-1) + 1


def sampling_distribution(
    logits: torch.Tensor, metadata: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the sampler draws each row from, made explicit (speculative decoding's rejection
    sampler needs the probabilities themselves): the argmax that greedy rows take, [num_rows]
    int64, and the probabilities sampled rows draw from, [num_rows, vocab] float32, or None when
    every row is greedy. Penalties, min_tokens bans, temperature, top-k, top-p and min-p as the
    sampler applies them; ``logits`` may be edited in place (bans), as the sampler may."""
    x = penalised(logits, metadata, copy=False)
    argmax = x.argmax(dim=-1)
    if metadata.all_greedy:
        return argmax, None
    x, inv_temperature = _truncate(x, metadata)
    return argmax, torch.softmax(x * inv_temperature[:, None], dim=-1)


def _draw_by_race(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Each row's token by the exponential race (greedy rows: the argmax)."""
    if metadata.all_greedy:
        return logits.argmax(dim=-1)
    logits, inv_temperature = _truncate(logits, metadata)
    return _race(logits, _exponential_noise(logits, metadata), inv_temperature, metadata.greedy)


def _draw_by_inverse_cdf(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Each row's token by inverting its CDF (greedy rows: the argmax)."""
    if metadata.all_greedy:
        return logits.argmax(dim=-1)
    logits, inv_temperature = _truncate(logits, metadata)
    return _inverse_cdf(logits, inv_temperature, metadata)


def _beam_scores(logprobs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """What top tokens are ranked by: the logprobs; for beam search rows, the logprobs with the
    penalties and min_tokens bans applied (HF's beam search applies its processors to them)."""
    if metadata.beam is None:
        return logprobs
    scores = penalised(logprobs, metadata, copy=True)
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
