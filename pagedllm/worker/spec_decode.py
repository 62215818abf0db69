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

Nothing waits for the verification inside its step (``PendingVerification``): the rejection
sampler's outputs update the persistent batch on the device (each request's next input and its
penalty counts) and start for the host, the drafter adds the accepted counts to its requests'
newest positions on the device (worker/draft_model.py: ``NewestPositions``). The host side has two
parts with two owners: the rows' lengths are applied to the persistent batch by the worker's own
thread when the next step starts (or, with the take-back deferred, once it is launched:
``DraftVerifier.settle``), and the step's samples are read by whoever returns the step's output,
which with tensor parallelism is a rank's reply thread, running beside the next step's planning
(executor/worker_loop.py): so reading the samples never touches the batch. With asynchronous
scheduling the next step is thus scheduled and prepared while the device runs this step's
forward, verification and drafter.

A drafter's proposals (draft model, EAGLE head) stay on the device (``DeviceDrafts``): the
scheduler schedules placeholders for them (``DRAFT_PLACEHOLDER``), and the step that verifies
them reads them where the drafter left them. With asynchronous scheduling the scheduler also
counts the drafts of the step in flight as accepted: for those requests
(``SchedulerOutput.optimistic_req_ids``) the worker takes its own rejections back from the
computed counts it receives (``take_back_rejected``), so that the next step's positions and slots
follow the tokens actually accepted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.layers.custom_op import platform_for
from pagedllm.sample.logits_processors import apply_allowed_token_ids, apply_logit_bias
from pagedllm.sample.rejection_sampler import RejectionSample, rejection_sample
from pagedllm.sample.sampler import sampling_distribution
from pagedllm.step_io import DRAFT_PLACEHOLDER, ModelRunnerOutput
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.input_buffers import to_device, to_host
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
        # Verifications whose requests are all greedy: one launch with Triton (a prefix match),
        # else the rejection sampler's torch form.
        self._greedy_verify = None
        if platform_for(input_batch.device).triton:
            from pagedllm.kernels.triton.greedy_verify import greedy_verify

            self._greedy_verify = greedy_verify
        # Per batch row, the drafts its latest verification rejected.
        self.num_rejected = np.zeros(input_batch.max_num_rows, dtype=np.int64)
        # The latest verification, until its counts are applied on the host.
        self._pending: PendingVerification | None = None

    def take_back_rejected(self, req_ids: set[int]) -> None:
        """The scheduler counted these requests' drafts of the step before as accepted (it had
        not seen that step's output): move their computed tokens back before the rejected ones."""
        batch = self.batch
        rows = np.fromiter((batch.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        batch.num_computed_tokens[rows] -= self.num_rejected[rows]

    def __call__(self, logits: torch.Tensor, verify: VerifyRows, drafts: torch.Tensor) -> PendingVerification:
        """logits: [sum(k + 1), vocab] float32, the verify rows' (edited in place); drafts:
        [num_verify_reqs, max k] int64 on the device, -1 past a request's drafts. Launches the
        verification and the persistent batch's device-side update, and returns without waiting:
        the host side follows when the next step starts or the samples are read (``settle``)."""
        self.settle()
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
            metadata.output_counts = metadata.output_counts + self._draft_counts(verify, drafts, logits)
        argmax, probs = sampling_distribution(logits, metadata)
        device = logits.device
        greedy = uniform = None
        if probs is not None:
            assert metadata.greedy is not None
            greedy = metadata.greedy[to_device(first, device)]
            uniform = self._uniforms(verify, device)
        if probs is None and self._greedy_verify is not None:
            sample = RejectionSample(
                *self._greedy_verify(drafts, num_drafts, argmax, self.synthetic_acceptance_rate)
            )
        else:
            sample = rejection_sample(
                drafts,
                to_device(num_drafts, device),
                argmax,
                probs,
                greedy,
                uniform,
                self.synthetic_acceptance_rate,
            )
        batch.record_verified_on_device(verify.rows, sample.output_token_ids, sample.num_accepted)
        chosen = logprobs[sample.row_index, sample.output_token_ids.clamp(min=0)]
        tensors = [sample.num_accepted, sample.output_token_ids, chosen]
        # Per request, how many top tokens it asked for beside its token's logprob (-1: no
        # logprobs), read now: the samples may be read by another thread once this thread has
        # moved the rows on.
        num_top = np.where(batch.wants_logprobs[verify.rows], batch.num_top_tokens[verify.rows], -1)
        if (num_top >= 0).any():
            tensors += self._top_tokens(verify, logprobs, sample.row_index, chosen)
        self._pending = PendingVerification(verify, tensors, num_top)
        return self._pending

    @property
    def pending(self) -> bool:
        """Whether the latest verification's counts have yet to be applied on the host."""
        return self._pending is not None

    def pending_rejections(self, req_ids: list[int], optimistic: set[int]) -> tuple[torch.Tensor, np.ndarray]:
        """Without waiting, what the pending verification rejected: ([num_verified + 1] int64 on
        the device, the drafts each verified request had rejected, then a 0; [len(req_ids)] int64
        on the host, each request's index there: its own if the scheduler counted it
        optimistically (``optimistic``), else the 0). ``take_back_rejected``'s amounts, before the
        counts reach the host."""
        assert self._pending is not None, "no verification pending"
        verify, accepted = self._pending.verify, self._pending.num_accepted
        slot = {req_id: j for j, req_id in enumerate(verify.req_ids)}
        none = len(verify.req_ids)
        index = [slot.get(r, none) if r in optimistic else none for r in req_ids]
        rejected = to_device(verify.num_drafts, accepted.device) - accepted
        return torch.cat([rejected, rejected.new_zeros(1)]), np.asarray(index, dtype=np.int64)

    def settle(self) -> None:
        """Bring the latest verification's counts to the host (waiting for them if need be) and
        apply them to the persistent batch; a no-op when there is none or it was applied. The
        worker's own thread only: it owns the batch."""
        if self._pending is not None:
            verify = self._pending.verify
            counts = self._pending.host()[0].numpy() + 1  # each request's accepted drafts, then one
            self.batch.count_verified(verify.rows, counts)
            self.num_rejected[verify.rows] = verify.num_drafts + 1 - counts
            self._pending = None

    def _draft_counts(self, verify: VerifyRows, drafts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """[sum(k + 1), vocab]: per verify row, how often each token occurs among its request's
        drafts before it (outputs, for penalties, once those drafts are accepted). drafts:
        [num_verify_reqs, max k] on the device; only the indices are built on the host."""
        counts = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        max_k = drafts.shape[1]
        index_rows: list[int] = []
        index_drafts: list[int] = []  # into drafts.view(-1)
        row = 0
        for i, k in enumerate(verify.num_drafts.tolist()):
            for j in range(1, k + 1):  # row j counts drafts 0 .. j - 1
                index_rows += [row + j] * j
                index_drafts += range(i * max_k, i * max_k + j)
            row += k + 1
        if index_rows:
            tokens = drafts.reshape(-1).index_select(0, to_device(index_drafts, logits.device))
            index = (to_device(index_rows, logits.device), tokens)
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
        self, verify: VerifyRows, logprobs: torch.Tensor, row_index: torch.Tensor, chosen: torch.Tensor
    ) -> list[torch.Tensor]:
        """[num_reqs, K + 1] ranks and [num_reqs, K + 1, k] top ids and logprobs of every output
        position (on the device; the host keeps those of the emitted tokens)."""
        k = int(self.batch.num_top_tokens[verify.rows].max()) or 1
        scored = logprobs[row_index]  # [num_reqs, K + 1, vocab]
        top_logprobs, top_ids = scored.topk(k, dim=-1)
        ranks = (scored > chosen[..., None]).sum(dim=-1) + 1
        return [ranks, top_ids, top_logprobs]


class PendingVerification:
    """A verification launched on the device: its tensors on their way to the host (one
    non-blocking copy each, then an event). ``samples()`` turns them into the step's samples,
    once, for whichever thread asks first; it reads nothing of the persistent batch, whose rows
    the worker's thread may be moving on meanwhile (``DraftVerifier.settle`` applies the counts
    there). num_top_tokens: [num_verify_reqs], the top tokens each request asked for (-1: no logprobs)."""

    def __init__(self, verify: VerifyRows, tensors: list[torch.Tensor], num_top_tokens: np.ndarray) -> None:
        self.verify = verify
        self.num_accepted = tensors[0]  # [num_verify_reqs] int64, on the device
        self._num_top_tokens = num_top_tokens
        self._host, self._event = to_host(tensors)
        self._lock = threading.Lock()
        self._samples: VerifiedSamples | None = None

    def host(self) -> list[torch.Tensor]:
        """The tensors on the host, once their copies landed: num_accepted [num_verify_reqs],
        output token ids [num_verify_reqs, K + 1], their logprobs, then the top tokens' three."""
        if self._event is not None:
            self._event.synchronize()
        return self._host

    def samples(self) -> VerifiedSamples:
        """The tokens each request emitted, one row per token, request by request."""
        with self._lock:
            if self._samples is None:
                self._samples = self._emitted(self.host())
            return self._samples

    def _emitted(self, host: list[torch.Tensor]) -> VerifiedSamples:
        verify = self.verify
        num_accepted, output_token_ids, chosen = (t.tolist() for t in host[:3])
        emitted = [tokens[: n + 1] for tokens, n in zip(output_token_ids, num_accepted)]
        out = VerifiedSamples(num_accepted_tokens=dict(zip(verify.req_ids, num_accepted)))
        for req_id, tokens, values in zip(verify.req_ids, emitted, chosen):
            out.req_ids += [req_id] * len(tokens)
            out.token_ids += tokens
            out.logprobs += values[: len(tokens)]
        if len(host) > 3:
            ranks, top_ids, top_logprobs = (t.tolist() for t in host[3:])
            out_row = 0
            for i, (tokens, num_top) in enumerate(zip(emitted, self._num_top_tokens.tolist())):
                for j in range(len(tokens)):
                    if num_top >= 0:
                        top = (ranks[i][j], top_ids[i][j][:num_top], top_logprobs[i][j][:num_top])
                        out.top_tokens[out_row] = top
                    out_row += 1
        return out


class DeviceDrafts:
    """A drafter's proposals on the device, per batch row: [rows, k] int64, the drafts after each
    row's newest token as of the latest step that sampled it. Args: the batch's row count, k and
    the device."""

    def __init__(self, max_num_rows: int, num_speculative_tokens: int, device: torch.device) -> None:
        self.device = device
        self.token_ids = torch.zeros((max_num_rows, num_speculative_tokens), dtype=torch.int64, device=device)

    def record(self, rows: np.ndarray, drafts: torch.Tensor) -> None:
        """drafts: [len(rows), k] (device), proposed after the rows' newest tokens."""
        if len(rows):
            self.token_ids.index_copy_(0, to_device(rows, self.device), drafts)

    def resolve(self, verify: VerifyRows, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's drafts, [num_verify_reqs, max k] int64 on the device (-1 past a request's):
        the scheduler's ids where it sent ids, the held proposals where it sent placeholders,
        which are also written into ``input_ids`` [num_tokens] at the drafts' tokens. Indices are
        built on the host and applied with gathers: no host sync."""
        host = verify.draft_token_ids
        device = self.device
        drafts = to_device(host, device)
        is_draft = np.arange(host.shape[1]) < verify.num_drafts[:, None]
        placeholder = (host == DRAFT_PLACEHOLDER) & is_draft
        if not placeholder.any():
            return drafts
        held = self.token_ids.index_select(0, to_device(verify.rows, device))[:, : host.shape[1]]
        drafts = torch.where(to_device(placeholder, device), held, drafts)
        # A request's verify rows are its newest token, then its drafts in order: the drafts'
        # tokens are every row but each request's first, in the row-major order of is_draft.
        num_rows = verify.num_drafts + 1
        is_first = np.zeros(int(num_rows.sum()), dtype=bool)
        is_first[np.cumsum(num_rows) - num_rows] = True
        draft_tokens = verify.logits_indices[~is_first]
        values = drafts.reshape(-1).index_select(0, to_device(np.flatnonzero(placeholder), device))
        input_ids.index_copy_(0, to_device(draft_tokens[placeholder[is_draft]], device), values)
        return drafts
