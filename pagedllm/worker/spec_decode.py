"""Speculative decoding, the worker's side: verify a step's drafts from the logits of the one
forward pass that computed them.

A request with k drafts was scheduled k + 1 tokens (its newest token, then the drafts) and went
through the model as k + 1 decode sequences (batch expansion: ``step_inputs.expand_decodes``,
under the decode CUDA graphs); its k + 1 hidden rows were scored (``step_inputs.verify_rows``).
Row j's logits give the target's distribution for the token after position j, shaped exactly as
the sampler shapes a sample (logit bias and allowed tokens, then penalties counting the drafts
before j as outputs, min_tokens bans counting them too, temperature, top-k, top-p, min-p:
``sampler.sampling_distribution``), and the rejection sampler (``sample/rejection_sampler.py``)
accepts a prefix of the drafts and draws one token more.

The emitted tokens are copied to the host before the step returns: the persistent batch needs
their number to know each row's length, and the scheduler needs them before it can draft again
(speculative steps are synchronous; ``EngineConfig`` refuses ``async_scheduling`` with them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.sample.logits_processors import apply_allowed_token_ids, apply_logit_bias
from pagedllm.sample.rejection_sampler import rejection_sample
from pagedllm.sample.sampler import sampling_distribution
from pagedllm.step_io import ModelRunnerOutput
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.input_buffers import to_device
from pagedllm.worker.step_inputs import VerifyRows


@dataclass
class VerifiedSamples:
    """A verification's emitted tokens on the host, one row per token, request by request."""

    req_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # Row -> (rank, top token ids, their logprobs) for the rows whose request asked for logprobs.
    top_tokens: dict[int, tuple[int, list[int], list[float]]] = field(default_factory=dict)
    num_accepted_tokens: dict[int, int] = field(default_factory=dict)

    def append_to(self, output: ModelRunnerOutput) -> None:
        """Add these rows after the output's own."""
        offset = len(output.req_ids)
        output.req_ids = output.req_ids + self.req_ids
        output.sampled_token_ids = output.sampled_token_ids + self.token_ids
        output.logprobs = output.logprobs + self.logprobs
        output.top_tokens.update({offset + row: top for row, top in self.top_tokens.items()})
        output.num_accepted_tokens.update(self.num_accepted_tokens)


class DraftVerifier:
    """Args:
    input_batch: the worker's persistent batch (the requests' parameters, penalty counts,
        generators), which the emitted tokens extend.
    synthetic_acceptance_rate: benchmarks only (``SpeculativeConfig``).
    """

    def __init__(self, input_batch: InputBatch, synthetic_acceptance_rate: float | None = None) -> None:
        self.batch = input_batch
        self.synthetic_acceptance_rate = synthetic_acceptance_rate

    def __call__(self, logits: torch.Tensor, verify: VerifyRows) -> VerifiedSamples:
        """logits: [sum(k + 1), vocab] float32, the verify rows' (edited in place)."""
        batch = self.batch
        num_drafts = verify.num_drafts
        num_rows = num_drafts + 1
        rows = np.repeat(verify.rows, num_rows)
        first = np.cumsum(num_rows) - num_rows  # each request's first verify row
        positions = np.arange(len(rows)) - np.repeat(first, num_rows)
        params = [batch.params[row] for row in rows.tolist()]
        if any(p.allowed_token_ids for p in params):
            apply_allowed_token_ids(logits, [p.allowed_token_ids for p in params])
        if any(p.logit_bias for p in params):
            apply_logit_bias(logits, [p.logit_bias for p in params])
        logprobs = torch.log_softmax(logits, dim=-1)  # the model's, as the sampler reports them
        metadata = batch.sampling_metadata(rows, output_offsets=positions)
        if metadata.output_counts is not None:
            metadata.output_counts = metadata.output_counts + self._draft_counts(verify, positions, logits)
        argmax, probs = sampling_distribution(logits, metadata)
        device = logits.device
        drafts = to_device(verify.draft_token_ids, device)
        greedy = uniform = None
        if probs is not None:
            assert metadata.greedy is not None
            greedy = metadata.greedy[to_device(first, device)]
            uniform = self._uniforms(verify, device)
        sample = rejection_sample(
            drafts,
            to_device(num_drafts, device),
            argmax,
            probs,
            greedy,
            uniform,
            self.synthetic_acceptance_rate,
        )
        chosen = logprobs[sample.row_index, sample.output_token_ids.clamp(min=0)]
        # The host waits here (see the module docstring).
        num_accepted = sample.num_accepted.tolist()
        emitted = [tokens[: n + 1] for tokens, n in zip(sample.output_token_ids.tolist(), num_accepted)]
        batch.record_verified(verify.rows, emitted)
        out = VerifiedSamples(num_accepted_tokens=dict(zip(verify.req_ids, num_accepted)))
        for req_id, tokens, values in zip(verify.req_ids, emitted, chosen.tolist()):
            out.req_ids += [req_id] * len(tokens)
            out.token_ids += tokens
            out.logprobs += values[: len(tokens)]
        if batch.wants_logprobs[verify.rows].any():
            self._top_tokens(out, verify, logprobs, sample.row_index, emitted, chosen)
        return out

    def _draft_counts(self, verify: VerifyRows, positions: np.ndarray, logits: torch.Tensor) -> torch.Tensor:
        """[sum(k + 1), vocab]: per verify row, how often each token occurs among its request's
        drafts before it (outputs, for penalties, once those drafts are accepted)."""
        counts = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        index_rows: list[int] = []
        index_tokens: list[int] = []
        row = 0
        for drafts, k in zip(verify.draft_token_ids.tolist(), verify.num_drafts.tolist()):
            for j in range(1, k + 1):  # row j counts drafts 0 .. j - 1
                index_rows += [row + j] * j
                index_tokens += drafts[:j]
            row += k + 1
        if index_rows:
            index = (to_device(index_rows, logits.device), to_device(index_tokens, logits.device))
            counts.index_put_(index, torch.ones(len(index_rows), device=logits.device), accumulate=True)
        return counts

    def _uniforms(self, verify: VerifyRows, device: torch.device) -> torch.Tensor:
        """[num_reqs, K + 1] draws in [0, 1): a seeded request's from its own generator."""
        shape = (len(verify.req_ids), verify.draft_token_ids.shape[1] + 1)
        uniform = torch.rand(shape, device=device)
        generators = self.batch.generators
        for i, req_id in enumerate(verify.req_ids):
            generator = generators.get(req_id)
            if generator is not None:
                uniform[i] = torch.rand(shape[1], generator=generator, device=device)
        return uniform

    def _top_tokens(
        self,
        out: VerifiedSamples,
        verify: VerifyRows,
        logprobs: torch.Tensor,
        row_index: torch.Tensor,
        emitted: list[list[int]],
        chosen: torch.Tensor,
    ) -> None:
        """Rank and top tokens of each emitted token whose request asked for logprobs."""
        batch = self.batch
        k = int(batch.num_top_tokens[verify.rows].max()) or 1
        scored = logprobs[row_index]  # [num_reqs, K + 1, vocab]
        top_logprobs, top_ids = scored.topk(k, dim=-1)
        ranks = (scored > chosen[..., None]).sum(dim=-1) + 1
        top_logprobs, top_ids, ranks = top_logprobs.tolist(), top_ids.tolist(), ranks.tolist()
        out_row = 0
        for i, (row, tokens) in enumerate(zip(verify.rows.tolist(), emitted)):
            num_top = int(batch.num_top_tokens[row])
            for j in range(len(tokens)):
                if batch.wants_logprobs[row]:
                    out.top_tokens[out_row] = (
                        ranks[i][j],
                        top_ids[i][j][:num_top],
                        top_logprobs[i][j][:num_top],
                    )
                out_row += 1
