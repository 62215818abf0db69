"""A rank's part of each forward pass under pipeline parallelism, chosen once per runner.

With one stage (``WholeModel``) the model runs whole and samples. With several
(``PipelineStage``; layout in distributed/parallel_state.py) a step flows through the stages in
order, each rank with the same ``ModelInput`` (every rank builds it from the same
``SchedulerOutput``)::

    stage 0                 embed, its layers           send (hidden, residual) ->
    stage i                 <- recv, its layers         send (hidden, residual) ->
    last stage              <- recv, its layers, norm, logits, sample
    every rank              <- the sampled tokens, broadcast by the last stage's first rank

so that every rank's persistent batch records the same samples (the first stage embeds them in
the next step that runs their requests). Activations cross as [num_tokens, hidden_size] tensors in
the model's dtype: twice ``num_tokens * hidden_size * element size`` bytes per stage boundary and
step.

Several steps are in flight at once, so that the stages work on different micro-batches at the
same time (GPipe's micro-batches, Huang et al. 2019; vLLM's virtual engines): with asynchronous
scheduling the engine sends step N + 1 before it applies step N, and the scheduler keeps a
request whose sample is still in flight out of the next step (core/scheduler.py), so consecutive
steps hold different requests. A stage before the last therefore does not wait for step N's
samples when it finishes N: it starts their broadcast (on a process group of its own, so that it
does not queue behind the next step's activations) and records them only before a step that
touches one of their requests (``samples_before``), by request id, dropping those that ended.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed import Work

from pagedllm.distributed import broadcast_from_last_stage, pipeline_recv, pipeline_send
from pagedllm.models.utils import IntermediateTensors
from pagedllm.step_io import SchedulerOutput

# forward(input_ids, positions, intermediate_tensors or None) -> hidden states or IntermediateTensors
Forward = Callable[..., "torch.Tensor | IntermediateTensors"]


class WholeModel:
    """One stage: the model runs whole on this rank, which samples."""

    is_last = True

    def forward(self, forward: Forward, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return forward(input_ids, positions)

    def share_samples(self, token_ids: torch.Tensor) -> None:
        pass

    def samples_before(self, scheduler_output: SchedulerOutput) -> tuple[()]:
        return ()


class PipelineStage:
    """This rank's stage of several.

    Args:
        stage, num_stages: which stage this rank runs, of how many (the runner is built before
            the rank joins its process group).
        tp_rank: its tensor-parallel rank in the stage (the last stage's rank 0 samples for all).
        hidden_size, dtype, device: the activations a stage boundary carries.
    """

    def __init__(
        self,
        stage: int,
        num_stages: int,
        tp_rank: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.is_source = self.is_last and tp_rank == 0
        self.num_stages = num_stages
        # Broadcasts started and not yet waited for: (operation, tensor it fills or sends), and
        # on a stage before the last the requests and sample indices of what it fills.
        self._sent: deque[tuple[Work | None, torch.Tensor]] = deque()
        self._pending: deque[_PendingSamples] = deque()

    def forward(
        self, forward: Forward, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor | None:
        """This stage's layers over the step's tokens: the final hidden states on the last stage,
        None on the others (their output went to the next stage)."""
        intermediate = None
        if not self.is_first:
            shape = (input_ids.shape[0], self.hidden_size)
            received = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(2)]
            intermediate = IntermediateTensors(*pipeline_recv(received))
        out = forward(input_ids, positions, intermediate)
        if self.is_last:
            return out
        pipeline_send([out.hidden_states, out.residual])
        return None

    def share_samples(self, token_ids: torch.Tensor) -> None:
        """The last stage, after sampling: start the step's samples [num sample rows] int64 on
        their way to every rank (the stage's other ranks drew the same, and take part only)."""
        tensor = token_ids.contiguous() if self.is_source else torch.empty_like(token_ids)
        self._sent.append((broadcast_from_last_stage(tensor), tensor))
        while len(self._sent) > self.num_stages:  # long done: release the tensors
            work, _ = self._sent.popleft()
            if work is not None:
                work.wait()

    def defer_samples(self, num_rows: int, req_ids: list[int], sample_index: np.ndarray) -> None:
        """A stage before the last: start receiving the step's ``num_rows`` samples, those of
        request ``req_ids[j]`` from ``sample_index[j]`` on; ``samples_before`` hands them out."""
        tokens = torch.empty(num_rows, dtype=torch.int64, device=self.device)
        work = broadcast_from_last_stage(tokens)
        self._pending.append(_PendingSamples(work, tokens, req_ids, sample_index))

    def samples_before(self, scheduler_output: SchedulerOutput) -> list[_PendingSamples]:
        """The received samples to record before this step changes or runs any of their requests
        (oldest first, as they were broadcast), waited for; and any beyond one per stage."""
        touched = _touched_req_ids(scheduler_output)
        pending = self._pending
        count = max(len(pending) - self.num_stages, 0)
        for i, samples in enumerate(pending):
            if not touched.isdisjoint(samples.req_ids):
                count = i + 1
        taken = [pending.popleft() for _ in range(count)]
        for samples in taken:
            if samples.work is not None:
                samples.work.wait()
        return taken


@dataclass
class _PendingSamples:
    """One step's samples on their way to a stage before the last."""

    work: Work | None
    tokens: torch.Tensor  # [num sample rows] int64, filled once ``work`` is done
    req_ids: list[int]
    sample_index: np.ndarray  # [len(req_ids)]: where each request's first sample is in ``tokens``


def _touched_req_ids(scheduler_output: SchedulerOutput) -> set[int]:
    """Every request a step runs, ends, preempts or (re)adds."""
    touched = set(scheduler_output.num_scheduled_tokens)
    touched |= scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids
    touched.update(data.req_id for data in scheduler_output.scheduled_new_reqs)
    touched.update(scheduler_output.scheduled_cached_reqs.req_ids)
    return touched
