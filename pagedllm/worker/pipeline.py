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
the next step). Activations cross as [num_tokens, hidden_size] tensors in the model's dtype: twice
``num_tokens * hidden_size * element size`` bytes per stage boundary and step.

One step is in flight at a time: while stage i runs, the others wait (GPipe's bubble with one
micro-batch). Keeping every stage busy needs several steps in flight (vLLM's virtual engines).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.distributed import broadcast_from_last_stage, pipeline_recv, pipeline_send
from pagedllm.models.utils import IntermediateTensors

# forward(input_ids, positions, intermediate_tensors or None) -> hidden states or IntermediateTensors
Forward = Callable[..., "torch.Tensor | IntermediateTensors"]


class WholeModel:
    """One stage: the model runs whole on this rank, which samples."""

    is_last = True

    def forward(self, forward: Forward, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return forward(input_ids, positions)

    def share_samples(self, token_ids: torch.Tensor) -> None:
        pass


class PipelineStage:
    """This rank's stage of several.

    Args:
        stage, num_stages: which stage this rank runs, of how many (the runner is built before
            the rank joins its process group).
        hidden_size, dtype, device: the activations a stage boundary carries.
    """

    def __init__(
        self, stage: int, num_stages: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1

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
        """The last stage: send the step's sampled tokens [num sample rows] int64 to every rank."""
        broadcast_from_last_stage(token_ids.contiguous())

    def receive_samples(self, num_rows: int) -> torch.Tensor:
        """A stage before the last: the step's sampled tokens, as the last stage drew them."""
        return broadcast_from_last_stage(torch.empty(num_rows, dtype=torch.int64, device=self.device))
