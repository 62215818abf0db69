"""The model runner of a pooling model (``runner="pooling"``): prefill only, no sampling.

Requests go through the same persistent batch, step plan and forward pass as a generating
model's (``ModelRunner``); what differs is after the forward pass. Each scheduled request's rows
of the final hidden states are folded into its pooler state (``layers/pooler.py``); a request
whose prompt is complete with this step (the step "samples" it, in the plan's terms) gets its
pooled vector, which goes back in ``ModelRunnerOutput.pooler_output`` in place of a token. The
scheduler then finishes it (``Scheduler.update_from_output``).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.layers.pooler import get_pooler
from pagedllm.step_io import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.input_buffers import to_host
from pagedllm.worker.model_runner import ModelRunner, StepOutput
from pagedllm.worker.step_inputs import StepPlan, stage_model_input


class PooledStepOutput(StepOutput):
    """A step's pooled vectors, possibly still on their way to the host."""

    def __init__(self, req_ids: list[int], pooled: torch.Tensor | None) -> None:
        super().__init__(None, None, [], [])
        self._req_ids = req_ids
        self._pooled = pooled  # [num_pooled, hidden_size] float32
        if pooled is not None:  # as for samples: the host waits only when it reads them
            (self._pooled,), self._event = to_host([pooled])

    def get(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
        output = ModelRunnerOutput()
        if self._pooled is not None:
            output.pooler_output = dict(zip(self._req_ids, self._pooled.tolist()))
        return output


class PoolingModelRunner(ModelRunner):
    """A ModelRunner whose step pools finished prompts instead of sampling."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # ModelRunner's arguments
        super().__init__(*args, **kwargs)
        pooler_config = self.config.pooler_config
        assert pooler_config is not None, "a pooling runner needs the model's pooler_config"
        self.pooler = get_pooler(pooler_config)
        # req_id -> the pooler's state of a request whose prompt is partly computed.
        self._states: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> StepOutput:
        """One forward pass over every scheduled token; the vectors of the prompts it completes."""
        assert self.model is not None, "load_model() first"
        self.update_states(scheduler_output)
        self._forget_states(scheduler_output)
        num_tokens = scheduler_output.total_num_scheduled_tokens
        if not num_tokens:
            return PooledStepOutput([], None)
        plan = self.plan_inputs(scheduler_output)
        model_input = stage_model_input(plan, self.input_batch, self.buffers, self.block_size, self.has_state)
        return self._pool(plan, self.run_model(model_input, num_tokens))

    def _forget_states(self, scheduler_output: SchedulerOutput) -> None:
        """Drop the states of requests that ended, and of those computed again from their first
        token (preempted by recompute: they come back new, with nothing computed)."""
        for req_id in scheduler_output.finished_req_ids:
            self._states.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            if new.num_computed_tokens == 0:
                self._states.pop(new.req_id, None)

    def _pool(self, plan: StepPlan, hidden_states: torch.Tensor) -> PooledStepOutput:
        """Fold each request's rows (hidden_states: [num_tokens, hidden_size], requests in the
        plan's order at ``query_start_loc``) into its state; finish those whose prompt ends here."""
        batch = self.input_batch
        completes = set(plan.sample_req_ids)  # the plan "samples" a request when its prompt ends
        query_start_loc = plan.req_query_start_loc.tolist()
        pooled_ids: list[int] = []
        pooled: list[torch.Tensor] = []
        for i, row in enumerate(plan.rows.tolist()):
            req_id = batch.req_ids[row]
            chunk = hidden_states[query_start_loc[i] : query_start_loc[i + 1]]
            state = self.pooler.pool_chunk(self._states.pop(req_id, None), chunk)
            if req_id in completes:
                pooled_ids.append(req_id)
                pooled.append(self.pooler.finish(state, int(batch.num_prompt_tokens[row])))
            else:
                self._states[req_id] = state
        # The stack copies each vector out of the hidden states (a captured graph's buffer).
        return PooledStepOutput(pooled_ids, torch.stack(pooled) if pooled else None)
