"""Turns a SchedulerOutput into one forward pass and one sampling pass over the persistent batch.

A step: apply the scheduler's diffs to the persistent batch (worker/input_batch.py); flatten the
scheduled requests, decodes first, into one batch of CSR offsets (worker/step_inputs.py); run the
model (a captured CUDA graph for decode-only steps); sample on the device; start the
copy of the samples to the host and return without waiting for it (``StepOutput.get`` waits), so
the engine can schedule the next step while this one runs.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.attention import bind_kv_caches, set_forward_context
from pagedllm.attention.backends.abstract import AttentionBackend, KVCache
from pagedllm.config import EngineConfig
from pagedllm.distributed import pipeline_stage_layers
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.lora.model_manager import LoRAModelManager
from pagedllm.platform import platform_for
from pagedllm.sample.sampler import Sampler, SamplerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.step_io import ModelRunnerOutput, NewRequestData, PromptLogprobsOutput, SchedulerOutput
from pagedllm.worker.cpu_compile import CompiledDecode
from pagedllm.worker.cuda_graph import CudaGraphRunner, default_capture_sizes, graph_capture_sizes
from pagedllm.worker.draft_model import NewestPositions
from pagedllm.worker.eagle import make_drafter
from pagedllm.worker.grammar_ranks import grammar_constraint
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.input_buffers import InputBuffers, to_device, to_host
from pagedllm.worker.piecewise_graph import PiecewiseGraphRunner, piecewise_sizes_for
from pagedllm.worker.pipeline import PipelineStage, WholeModel
from pagedllm.worker.request_logits import RequestLogitsProcessors
from pagedllm.worker.spec_decode import DeviceDrafts, DraftVerifier, PendingVerification
from pagedllm.worker.step_inputs import ModelInput, StepPlan, max_num_step_seqs, plan_step, stage_model_input
from pagedllm.worker.take_back import TakeBack, take_back_on_device, take_back_torch


class StepOutput:
    """A step's samples, possibly still on their way to the host. ``get()`` waits for them."""

    def __init__(
        self,
        model_input: ModelInput | None,
        sampled: SamplerOutput | None,
        top_rows: list[int],
        prompt_logprobs: list[tuple[int, int, list[int], torch.Tensor, tuple]],
        num_top_tokens: list[int] | None = None,
        verified: PendingVerification | None = None,
    ) -> None:
        self._model_input = model_input
        # Tokens emitted by a verification of drafts (rows after the others), once on the host.
        self._verified = verified
        self._top_rows = top_rows
        # Per top row, how many top tokens its request asked for.
        self._num_top_tokens = num_top_tokens or []
        self._prompt_logprobs = prompt_logprobs
        self._host: list[torch.Tensor | None] = []
        self._event = None
        # The drafter's proposals (worker/draft_model.py): their requests, and the ids on their
        # way to the host behind the drafter's work.
        self._proposal_req_ids: list[int] = []
        self._proposals: torch.Tensor | None = None
        self._proposals_event = None
        if sampled is None:
            return
        tensors = [sampled.token_ids, sampled.logprobs]
        if top_rows:
            tensors += [sampled.ranks, sampled.top_token_ids, sampled.top_logprobs]
        # The host waits only when it reads the samples, one step later with asynchronous
        # scheduling. The samples' buffer holds -1 until its copy lands, which the grammar thread
        # waits on.
        self._host, self._event = to_host(tensors, first_fill=-1)

    def carry_proposals(self, req_ids: list[int], drafts: torch.Tensor) -> None:
        """drafts: [len(req_ids), k] int64 (device), the drafter's proposals: copied to the host
        without waiting (the scheduler learns from them which requests have drafts)."""
        self._proposal_req_ids = req_ids
        (self._proposals,), self._proposals_event = to_host([drafts])

    def samples_on_host(self) -> torch.Tensor:
        """The sampled ids' host buffer [num sample rows] int64, without waiting: on CUDA it holds
        -1 until the copy lands."""
        return self._host[0]

    def sampled_token_ids(self) -> list[int]:
        """The sampled ids of the step's sample rows, once they are on the host."""
        if self._event is not None:
            self._event.synchronize()
        return self._host[0].tolist() if self._host else []

    def get(self) -> ModelRunnerOutput:
        output = ModelRunnerOutput()
        if self._event is not None:
            self._event.synchronize()
        if self._host:
            assert self._model_input is not None
            output.req_ids = self._model_input.sample_req_ids
            output.sampled_token_ids = self._host[0].tolist()
            output.logprobs = self._host[1].tolist()
        if self._top_rows:
            ranks, top_ids, top_logprobs = (t.tolist() for t in self._host[2:5])
            for i, k in zip(self._top_rows, self._num_top_tokens):
                output.top_tokens[i] = (ranks[i], top_ids[i][:k], top_logprobs[i][:k])
        for req_id, start, targets, chosen, (ranks, top_values, top_ids, k) in self._prompt_logprobs:
            output.prompt_logprobs[req_id] = PromptLogprobsOutput(
                start,
                targets,
                chosen.tolist(),
                ranks.tolist(),
                [ids[:k] for ids in top_ids.tolist()],
                [values[:k] for values in top_values.tolist()],
            )
        if self._verified is not None:
            self._verified.samples().append_to(output)
        if self._proposals is not None:
            if self._proposals_event is not None:
                self._proposals_event.synchronize()
            output.draft_token_ids = dict(zip(self._proposal_req_ids, self._proposals.tolist()))
        return output


class ModelRunner:
    def __init__(self, config: EngineConfig, attn_backend: type[AttentionBackend], rank: int = 0) -> None:
        self.config = config
        self.device = config.device_config.device
        self.block_size = config.cache_config.block_size
        parallel_config = config.parallel_config
        stage, cp_rank, tp_rank = parallel_config.rank_layout(rank)
        # This rank's share of every sequence's cache (context parallelism: every cp_size-th token,
        # worker/step_inputs.py), and the tokens of one of the scheduler's blocks.
        self.stripe = (cp_rank, parallel_config.context_parallel_size)
        self.tokens_per_block = self.block_size * parallel_config.context_parallel_size
        self.attn_backend = attn_backend
        self.model: nn.Module | None = None
        self.sampler = Sampler(self.device, batch_invariant=config.batch_invariant)
        scheduler_config = config.scheduler_config
        self.max_model_len = config.model_config.max_model_len
        # This rank's part of each forward pass (worker/pipeline.py). Pipeline stages run eagerly:
        # a captured graph would need the stage boundary's buffers as its inputs and outputs.
        self.stage: WholeModel | PipelineStage = WholeModel()
        if parallel_config.pipeline_parallel_size > 1:
            model_config = config.model_config
            self.stage = PipelineStage(
                stage,
                parallel_config.pipeline_parallel_size,
                tp_rank,
                model_config.hidden_size,
                model_config.dtype,
                self.device,
            )
        self.use_cuda_graphs = (
            self.device.type == "cuda"
            and not config.enforce_eager
            and attn_backend.supports_cuda_graphs
            and parallel_config.pipeline_parallel_size == 1
        )
        spec_config = config.speculative_config
        # Verifications of drafts run as decodes, one per token (batch expansion,
        # worker/step_inputs.py), so that they replay the decode graphs; not for a model with a
        # recurrent state, which advances it token by token (EngineConfig refuses them anyway).
        # The most tokens a request verifies (0: no expansion) bounds the query groups.
        expand = spec_config is not None and not config.model_config.has_recurrent_state
        self.expand_verify = spec_config.num_speculative_tokens + 1 if expand else 0
        max_num_seqs = scheduler_config.max_num_seqs
        max_num_attn_seqs = max_num_step_seqs(
            max_num_seqs, scheduler_config.max_num_batched_tokens, max(self.expand_verify - 1, 0)
        )
        self.capture_sizes = (
            graph_capture_sizes(max_num_seqs, max_num_attn_seqs) if self.use_cuda_graphs else []
        )
        # Steps with prompt tokens in graphs cut at the attention calls, where asked and allowed.
        self.piecewise_sizes = piecewise_sizes_for(config) if self.use_cuda_graphs else []
        max_blocks_per_req = -(-self.max_model_len // self.tokens_per_block)
        self.buffers = InputBuffers(
            max_num_tokens=max([scheduler_config.max_num_batched_tokens, *self.capture_sizes]),
            max_num_seqs=max_num_attn_seqs,
            max_blocks_per_seq=max_blocks_per_req,
            device=self.device,
        )
        # Rows for every request the scheduler can keep running, and the forks a best_of request
        # adds after its first sample (bounded by max_num_seqs too; the slack is for requests
        # that finished in a step still in flight).
        self.input_batch = InputBatch(
            2 * scheduler_config.max_num_seqs, max_blocks_per_req, config.model_config.vocab_size, self.device
        )
        grammars = grammar_constraint(
            config.model_config,
            tp_rank,
            parallel_config.tensor_parallel_size,
            fill_ahead=self.device.type == "cuda",
            samples=self.stage.is_last,
        )
        self.logits_processors = RequestLogitsProcessors(self.input_batch, grammars)
        self.graph_runner: CudaGraphRunner | None = None
        self.piecewise_runner: PiecewiseGraphRunner | None = None
        self.compiled_decode: CompiledDecode | None = None
        self.verifier = (
            None
            if spec_config is None
            else DraftVerifier(self.input_batch, spec_config.synthetic_acceptance_rate)
        )
        # Speculative decoding with a draft model or an EAGLE head: it runs after every step's samples.
        self.drafter = make_drafter(config, attn_backend, self.input_batch, self.buffers.max_num_tokens)
        # Its proposals, which the next verification of each request reads on the device.
        self.device_drafts = (
            None
            if spec_config is None
            else DeviceDrafts(self.input_batch.max_num_rows, spec_config.num_speculative_tokens, self.device)
        )
        # With asynchronous scheduling a step of decodes is planned over the optimistic counts and
        # moved back by the step in flight's rejections on the device (``take_back_on_device``),
        # instead of waiting for them: where its inputs are read from the device only (a CUDA
        # graph's buffers; on the CPU the host's copies are the same tensors), and the plain slot
        # mapping holds (no context parallelism).
        self.takes_back_on_device = (
            self.verifier is not None
            and parallel_config.context_parallel_size == 1
            and (self.use_cuda_graphs or self.device.type == "cpu")
        )
        # Its arithmetic: one Triton launch where Triton runs (kernels/triton/take_back.py), else
        # about a dozen torch kernels (``take_back_torch``).
        self._take_back_kernel: TakeBack = take_back_torch
        if self.takes_back_on_device and platform_for(self.device).triton:
            from pagedllm.kernels.triton.take_back import take_back

            self._take_back_kernel = take_back
        # The requests whose take-back waits for the step in flight's counts (None: none waits).
        self._deferred_take_back: set[int] | None = None
        # With enable_lora: the model's projections wrapped, and the adapters' slots.
        self.lora_manager: LoRAModelManager | None = None
        # Whether the model keeps a recurrent state per request (hybrid models): the step then
        # carries each request's state row (worker/state_cache.py binds the state).
        self.has_state = False

    def load_model(self) -> None:
        from pagedllm.model_loader import get_model

        config = self.config
        self.model = get_model(
            config.model_config, config.load_config.load_format, self.device, self.attn_backend
        )
        if self.drafter is not None:
            self.drafter.load_model(self.model)
        if config.lora_config is not None:
            stage_layers = None
            if isinstance(self.stage, PipelineStage):
                stage_layers = pipeline_stage_layers(config.model_config.num_layers)
            self.lora_manager = LoRAModelManager(
                self.model,
                config.lora_config,
                config.model_config.hf_config,
                self.buffers.max_num_tokens,
                self.device,
                stage_layers,
            )

    # --- setup: memory profile and CUDA graphs ----------------------------------------------

    @torch.inference_mode()
    def profile_run(self, kv_caches: list[KVCache]) -> None:
        """One step at the largest size the scheduler can make: max_num_batched_tokens prompt
        tokens over max_num_seqs requests, each sampled with top-p (the sampler's biggest
        temporaries). ``kv_caches`` may be a single block: every dummy token maps into it. They
        are bound for the step only."""
        scheduler_config = self.config.scheduler_config
        num_tokens = scheduler_config.max_num_batched_tokens
        num_reqs = min(scheduler_config.max_num_seqs, num_tokens)
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1)
        out = SchedulerOutput()
        for i in range(num_reqs):
            prompt_len = min(num_tokens // num_reqs + (i < num_tokens % num_reqs), self.max_model_len)
            num_blocks = -(-prompt_len // self.tokens_per_block)
            out.scheduled_new_reqs.append(
                NewRequestData(i, None, [0] * prompt_len, [], params, [0] * num_blocks, 0, 1, [], 0)
            )
            out.num_scheduled_tokens[i] = prompt_len
            out.total_num_scheduled_tokens += prompt_len
        assert self.model is not None
        bind_kv_caches(self.model, kv_caches)
        try:
            self.execute_model(out).get()
        finally:
            bind_kv_caches(self.model, None)
        # A stage before the last waits for the profile step's samples and drops them: the dummy
        # requests' ids come again as real requests.
        self.stage.samples_before(out)
        for i in range(num_reqs):
            self.input_batch.remove_request(i, finished=True)
        self.sampler.warm_up(self.config.model_config.vocab_size, self.device)
        self._warm_up_experts(num_tokens)
        torch.cuda.synchronize(self.device)

    def _warm_up_experts(self, max_num_tokens: int) -> None:
        """Compile the MoE layers' kernels for every step size now (once per expert shape: the
        layers of a model share their compiled kernels)."""
        assert self.model is not None
        shapes = set()
        for module in self.model.modules():
            if isinstance(module, FusedMoE):
                shape = (tuple(module.gate_up_proj.shape), module.gate_up_proj.dtype, module.top_k)
                if shape not in shapes:
                    shapes.add(shape)
                    module.warm_up(max_num_tokens)

    def initialize_kv_cache(self, kv_caches: list[KVCache]) -> None:
        """Bind each attention layer to its cache (one per layer with a KV cache, in order)."""
        assert self.model is not None
        bind_kv_caches(self.model, kv_caches)

    def capture_model(self) -> None:
        """Compile the CPU's one-stream decode step, or capture the CUDA graphs of decode steps,
        over the bound caches."""
        assert self.model is not None
        if self.config.compile_cpu_decode and not self.has_state and CompiledDecode.supports(self.model):
            self.compiled_decode = CompiledDecode(self.model)
            self.compiled_decode.compile()
        if not self.use_cuda_graphs:
            return
        if self.lora_manager is not None:
            self.lora_manager.prepare_capture()
        self.graph_runner = CudaGraphRunner(
            self.model, self.buffers, self.capture_sizes, self.max_model_len, max(self.expand_verify, 1)
        )
        self.graph_runner.capture()
        if self.piecewise_sizes:
            self.piecewise_runner = PiecewiseGraphRunner(
                self.model, self.buffers, self.piecewise_sizes, self.max_model_len, self.tokens_per_block
            )
            self.piecewise_runner.capture()
        if self.drafter is not None:  # its proposal loop and its pass over the step's tokens
            sizes = default_capture_sizes(self.config.scheduler_config.max_num_seqs)
            self.drafter.capture_graphs(sizes, self.graph_runner)

    # --- the step ---------------------------------------------------------------------------

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the step's diffs to the persistent batch (first, on a pipeline stage before the
        last, the samples of earlier steps that this one needs: worker/pipeline.py)."""
        deferred = self._defers_take_back(scheduler_output)
        if self.verifier is not None and not deferred:
            self.verifier.settle()  # the last verification's counts, before any row changes
        for samples in self.stage.samples_before(scheduler_output):
            self._record_received_samples(samples.req_ids, samples.sample_index, samples.tokens)
        dropped = scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids
        if dropped:
            self.logits_processors.drop(dropped)
        self.input_batch.apply_scheduler_output(scheduler_output)
        if deferred:
            self._deferred_take_back = scheduler_output.optimistic_req_ids
        elif scheduler_output.optimistic_req_ids:
            assert self.verifier is not None, "drafts counted by a runner without speculative_config"
            self.verifier.take_back_rejected(scheduler_output.optimistic_req_ids)

    def _defers_take_back(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether the step's optimistic counts are moved back on the device: a step of decodes
        and verifications only (a graph's size at most, on a GPU) over rows that keep their
        requests (no row is reused before the pending counts are applied to it) and drop no
        blocks behind a window."""
        verifier = self.verifier
        if not (self.takes_back_on_device and scheduler_output.optimistic_req_ids):
            return False
        assert verifier is not None
        if not verifier.pending or scheduler_output.scheduled_new_reqs or scheduler_output.num_dropped_tokens:
            return False
        drafts = scheduler_output.scheduled_spec_decode_tokens
        num_scheduled = scheduler_output.num_scheduled_tokens
        decodes = (n == 1 + len(drafts.get(req_id, ())) for req_id, n in num_scheduled.items())
        if not num_scheduled or not all(decodes):
            return False
        row_of = self.input_batch.row_of
        rows = np.fromiter((row_of[r] for r in num_scheduled), dtype=np.int64, count=len(num_scheduled))
        if self.input_batch.num_dropped_tokens[rows].any():
            return False
        if self.device.type == "cpu":
            return True
        graphs = self.graph_runner
        return graphs is not None and scheduler_output.total_num_scheduled_tokens <= graphs.max_batch_size

    def _take_back(self, model_input: ModelInput) -> None:
        """The deferred take-back: the staged inputs moved back on the device by the pending
        verification's rejections (``take_back_on_device``)."""
        optimistic = self._deferred_take_back
        assert optimistic is not None and self.verifier is not None and model_input.req_rows is not None
        # On a GPU the step must replay a graph, which reads the device buffers alone.
        assert model_input.graph_num_seqs is not None or self.device.type == "cpu"
        batch = self.input_batch
        req_ids = [batch.req_ids[row] for row in model_input.req_rows.tolist()]
        rejected, req_index = self.verifier.pending_rejections(req_ids, optimistic)
        take_back_on_device(model_input, rejected, req_index, self.block_size, self._take_back_kernel)

    def _settle_deferred(self) -> None:
        """Once the step is launched: the pending counts applied on the host, and the optimistic
        computed counts moved back there too, before anything on the host reads them."""
        if self._deferred_take_back is None:
            return
        assert self.verifier is not None
        self.verifier.settle()
        self.verifier.take_back_rejected(self._deferred_take_back)
        self._deferred_take_back = None

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInput:
        """The step's flattened batch, decodes first, in the input buffers (worker/step_inputs.py)."""
        plan = self.plan_inputs(scheduler_output)
        return stage_model_input(plan, self.input_batch, self.buffers, self.tokens_per_block, self.has_state)

    def plan_inputs(self, scheduler_output: SchedulerOutput) -> StepPlan:
        """The step's flattened batch on the host (and the adapters' rows, with LoRA)."""
        num_scheduled = scheduler_output.num_scheduled_tokens
        plan = plan_step(
            self.input_batch,
            num_scheduled,
            self.block_size,
            self.graph_runner,
            scheduler_output.scheduled_spec_decode_tokens,
            self.expand_verify,
            self.stripe,
        )
        if self.lora_manager is not None:
            # Per attention sequence: an expanded request's adapter on each of its tokens.
            self.lora_manager.prepare_step(
                (data.lora_request for data in scheduler_output.scheduled_new_reqs),
                self.input_batch.lora_int_ids[plan.seq_rows],
                plan.query_start_loc,
                plan.pad_to,
            )
        return plan

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> StepOutput:
        """One forward pass over every scheduled token, then a sample for each request that
        reaches its end and the prompt logprobs asked for. Returns without waiting for the
        samples to reach the host."""
        assert self.model is not None, "load_model() first"
        self.update_states(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            return StepOutput(None, None, [], [])
        model_input = self.prepare_inputs(scheduler_output)
        if self._deferred_take_back is not None:
            self._take_back(model_input)
        verify_drafts = None
        if model_input.verify is not None:
            assert self.device_drafts is not None, "drafts sent to a runner without speculative_config"
            verify_drafts = self.device_drafts.resolve(model_input.verify, model_input.input_ids)
        hidden_states = self.run_model(model_input, scheduler_output.total_num_scheduled_tokens)
        self._settle_deferred()
        if hidden_states is None:  # a pipeline stage before the last, which samples
            return self._follow_samples(model_input)
        drafter = self.drafter if self.drafter is not None and self.drafter.ready else None
        if drafter is not None:
            drafter.prefill(model_input, hidden_states)
            if drafter.proposes_statelessly and not scheduler_output.drafting:
                drafter = None  # no proposals the scheduler would read
        if model_input.logits_indices.numel() == 0:
            if drafter is not None:  # nothing to propose, but an EAGLE head's K/V to write
                rows = model_input.sampling_req_rows
                drafter.propose(rows, NewestPositions(self.input_batch.num_tokens[rows] - 1))
            return StepOutput(model_input, None, [], [])
        logits = self.model.compute_logits(hidden_states[model_input.logits_indices])
        num_sample_rows = len(model_input.sample_rows)
        batch = self.input_batch
        sampled = None
        top_rows: list[int] = []
        if num_sample_rows:
            # Allowed tokens, logit bias and bad words edit the logits; a grammar gives a bitmask,
            # which the sampler applies.
            token_bitmask = self.logits_processors.before_sampling(logits[:num_sample_rows], model_input)
            metadata = batch.sampling_metadata(model_input.sample_rows)
            sampled = self.sampler(logits[:num_sample_rows], metadata, token_bitmask)
            self.stage.share_samples(sampled.token_ids)
            first = to_device(model_input.first_sample_index, self.device)
            batch.record_samples(model_input.sampling_req_rows, first, sampled.token_ids)
            if metadata.max_num_top_tokens:
                top_rows = np.flatnonzero(batch.wants_logprobs[model_input.sample_rows]).tolist()
        num_scored_rows = num_sample_rows + model_input.num_verify_rows
        verified = None
        if model_input.verify is not None:
            assert self.verifier is not None and verify_drafts is not None
            verified = self.verifier(
                logits[num_sample_rows:num_scored_rows], model_input.verify, verify_drafts
            )
        prompt_logprobs = self._score_prompts(logits[num_scored_rows:], model_input)
        num_top_tokens = batch.num_top_tokens[model_input.sample_rows[top_rows]].tolist() if top_rows else []
        step = StepOutput(model_input, sampled, top_rows, prompt_logprobs, num_top_tokens, verified)
        if num_sample_rows:
            self.logits_processors.after_launch(step)
        if drafter is not None:
            rows = model_input.sampling_req_rows
            newest = NewestPositions(batch.num_tokens[rows] - 1)
            if verified is not None:
                # The verified requests' newest tokens, after the others': past the drafts they
                # accepted, which the drafter adds on the device (their counts reach the host a
                # step later).
                verify_rows = model_input.verify.rows
                newest = NewestPositions(
                    np.concatenate([newest.host, batch.num_tokens[verify_rows]]), verified.num_accepted
                )
                rows = np.concatenate([rows, verify_rows])
            rows, drafts = drafter.propose(rows, newest)
            assert self.device_drafts is not None
            self.device_drafts.record(rows, drafts)
            step.carry_proposals([batch.req_ids[row] for row in rows.tolist()], drafts)
        return step

    def _follow_samples(self, model_input: ModelInput) -> StepOutput:
        """A stage before the last: start receiving the samples the last stage draws (recorded
        before a later step needs them, ``update_states``)."""
        if len(model_input.sample_rows):
            assert isinstance(self.stage, PipelineStage)
            req_ids = [self.input_batch.req_ids[row] for row in model_input.sampling_req_rows]
            num_rows = len(model_input.sample_rows)
            self.stage.defer_samples(num_rows, req_ids, np.asarray(model_input.first_sample_index))
        return StepOutput(model_input, None, [], [])

    def _record_received_samples(
        self, req_ids: list[int], sample_index: np.ndarray, tokens: torch.Tensor
    ) -> None:
        """Record an earlier step's samples for its requests still here, as the last stage did."""
        batch = self.input_batch
        kept = [(batch.row_of[req_id], j) for j, req_id in enumerate(req_ids) if req_id in batch.row_of]
        if kept:
            rows, index = (np.array(column, dtype=np.int64) for column in zip(*kept))
            batch.record_samples(rows, to_device(sample_index[index], self.device), tokens)

    def run_model(self, model_input: ModelInput, num_tokens: int) -> torch.Tensor | None:
        """The forward pass: a captured graph (which reads the input buffers: no context), or the
        compiled decode step or the eager model under the step's forward context. Returns the
        final hidden states, [num_tokens (padded under a graph), hidden_size]; None on a pipeline
        stage before the last (its output went on to the next stage)."""
        assert self.model is not None
        if model_input.graph_num_seqs is not None:
            assert self.graph_runner is not None
            return self.graph_runner.replay(model_input.graph_num_seqs)
        pieces = self.piecewise_runner
        if pieces is not None and num_tokens <= pieces.max_num_tokens:
            return pieces.replay(num_tokens, model_input.attn_metadata)
        forward = self.model
        if self.compiled_decode is not None and CompiledDecode.applies(model_input.attn_metadata, num_tokens):
            forward = self.compiled_decode
        with set_forward_context(model_input.attn_metadata):
            return self.stage.forward(forward, model_input.input_ids, model_input.positions)

    def _score_prompts(
        self, logits: torch.Tensor, model_input: ModelInput
    ) -> list[tuple[int, int, list[int], torch.Tensor, tuple]]:
        """logits: [prompt rows, vocab], the requests' rows in order."""
        requests = model_input.prompt_logprob_requests
        if not requests:
            return []
        batch = self.input_batch
        targets = to_device([t for _, _, ts in requests for t in ts], logits.device, torch.int64)
        logprobs = self.sampler.log_softmax(logits)  # the sampler's, to the bit
        chosen = logprobs.gather(-1, targets[:, None]).squeeze(-1)
        ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
        scored = []
        row = 0
        for req_id, start, ts in requests:
            k = batch.params[batch.row_of[req_id]].prompt_logprobs or 0
            rows = slice(row, row + len(ts))
            top_values, top_ids = logprobs[rows].topk(max(k, 1), dim=-1)
            scored.append((req_id, start, ts, chosen[rows], (ranks[rows], top_values, top_ids, k)))
            row += len(ts)
        return scored
