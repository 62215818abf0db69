"""Speculative decoding with an EAGLE head (vLLM's ``eagle`` and ``eagle3`` methods), the worker's
side: a one-layer head drafts from the TARGET's hidden states (models/llama_eagle.py), run by the
same worker after the target's step, its proposals travelling back like a draft model's
(``ModelRunnerOutput.draft_token_ids``).

The head keeps its own KV cache on the target's block ids with scratch blocks for proposals,
exactly as the draft model's (worker/draft_model.py, whose runner this one extends): what
differs is what the head reads. At position p it reads the target's hidden state at p and the
token at p + 1, and predicts the token at p + 2::

    step scheduled for request R: positions p0 .. p0 + n - 1 (a prompt chunk, a decode, or the
    newest token and k drafts being verified); after sampling/verification its newest token t
    sits at position P (P - 1 is the last position whose token the target confirmed)

    head pass over the step's tokens   token p + 1 beside the target's hidden state at p, for every
                                       scheduled p: the next prompt token (host), the next draft
                                       (verified rows), and at P - 1 the newest token t (device);
                                       K/V written to the target's slots. Logits at P - 1 -> d1
    k - 1 head steps                   d_j at position P + j - 2 beside the head's own previous
                                       output (pre-norm), through scratch blocks -> d_j+1

so the first draft costs no extra head step (vLLM's EAGLE proposer does the same). The k - 1 head
steps are the draft model's proposal loop with the head's step, replayed from a CUDA graph where
graphs are on (worker/proposal_graphs.py), as is the pass when the target's step replayed one
(``StepPassGraphs``: its next tokens in ``pass_ids``). P may include the drafts the step's
verification accepted, which stay on the device: the pass picks its rows at P - 1 by a device
index. Positions past P - 1 of a verified row hold rejected drafts: their head K/V is garbage that
the next step rewrites, as the target's.

**The target's hidden states.** EAGLE reads the target's last hidden state (after its final norm):
what the forward pass returns. EAGLE-3 reads the residual stream entering three of its layers
(``eagle3_aux_layer_ids``): forward hooks, registered once at load on the layers before them,
copy it into a static [max_num_tokens, 3 * hidden] buffer during the target's forward pass, so a
captured CUDA graph replays the copies too and the models' signatures stay as they are.

Drafts are argmax tokens (point masses), verified by the same lossless rejection sampler as every
method's: the head's quality costs acceptance, never output. A prefix-cache hit reuses the head's
K/V of the cached block, whose last position read the token after it in the request that computed
it: a different continuation there costs acceptance only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from pagedllm.attention import set_forward_context
from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.config import EngineConfig
from pagedllm.models.llama_eagle import Eagle3LlamaForCausalLM, EagleLlamaForCausalLM, eagle3_aux_layer_ids
from pagedllm.models.mtp import mtp_head_class
from pagedllm.worker.cuda_graph import CudaGraphRunner
from pagedllm.worker.draft_model import DraftModelRunner, NewestPositions, unpadded_inputs
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.input_buffers import to_device
from pagedllm.worker.ngram_drafter import NgramDrafter
from pagedllm.worker.step_inputs import ModelInput


class AuxHiddenStates:
    """The residual stream entering chosen target layers, captured during the target's forward.

    Each layer ``i`` of ``layer_ids`` gets a forward hook on what feeds it (layer ``i - 1``, whose
    output is ``(block output, residual)``, summed; the embedding for ``i = 0``) that copies its
    rows into columns ``[j * hidden, (j + 1) * hidden)`` of ``buffer`` ([max_num_tokens,
    len(layer_ids) * hidden]). The buffer is allocated once: a CUDA graph captures the copies.
    """

    def __init__(
        self, target: nn.Module, layer_ids: Sequence[int], max_num_tokens: int, hidden_size: int
    ) -> None:
        decoder = getattr(target, "model", None)
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(
                f"speculative_config method 'eagle3' needs a decoder with model.layers; "
                f"{type(target).__name__} has none"
            )
        param = next(target.parameters())
        self.buffer = torch.zeros(
            (max_num_tokens, len(layer_ids) * hidden_size), dtype=param.dtype, device=param.device
        )
        for j, layer_id in enumerate(layer_ids):
            feeder = decoder.embed_tokens if layer_id == 0 else layers[layer_id - 1]
            feeder.register_forward_hook(self._copy_into(j * hidden_size, (j + 1) * hidden_size))

    def _copy_into(self, lo: int, hi: int) -> Callable[[nn.Module, tuple, object], None]:
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            stream = output if isinstance(output, torch.Tensor) else output[0] + output[1]
            self.buffer[: stream.shape[0], lo:hi].copy_(stream)

        return hook


class EagleProposer(DraftModelRunner):
    """An EAGLE(-3) head and its KV cache, beside the target's ``ModelRunner``.

    Args:
        config: the engine's configuration (``draft_model_config``: the head's).
        attn_backend: the target's backend class, which the head's layer uses too.
        input_batch: the target runner's persistent batch (block tables, tokens).
        max_num_tokens: the most tokens a target step runs (the hidden-state buffer's rows).
    """

    def __init__(
        self,
        config: EngineConfig,
        attn_backend: type[AttentionBackend],
        input_batch: InputBatch,
        max_num_tokens: int,
    ) -> None:
        super().__init__(config, attn_backend, input_batch)
        if config.compile_cpu_decode:
            raise ValueError(
                "cpu_compile is not supported with speculative_config method 'eagle'/'eagle3' yet (the "
                "compiled step does not run the hooks that hand the head the target's hidden states)"
            )
        assert config.speculative_config is not None
        self.method = config.speculative_config.method
        self.is_eagle3 = self.method == "eagle3"
        self.num_target_layers = config.model_config.num_layers
        self.max_num_tokens = max_num_tokens
        self.aux: AuxHiddenStates | None = None
        # Chosen at load: the head's embeddings or the target's; its LM head or the target's.
        self.embed: nn.Module | None = None
        self.compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        # The step's target inputs and last hidden states, from prefill to propose.
        self._pending: tuple[ModelInput, torch.Tensor] | None = None

    def load_model(self, target: nn.Module) -> None:
        from pagedllm.model_loader import get_model

        head_classes = {"eagle3": Eagle3LlamaForCausalLM, "eagle": EagleLlamaForCausalLM}
        head_class = mtp_head_class(type(target)) if self.method == "mtp" else head_classes[self.method]
        head = get_model(self.model_config, self.load_format, self.device, self.attn_backend, head_class)
        if not head.loaded_embeddings:
            head.embed_tokens = None  # the checkpoint shares the target's
        self.embed = head.embed_tokens if head.embed_tokens is not None else target.model.embed_tokens
        own_head = self.is_eagle3 or getattr(head, "loaded_lm_head", False)
        self.compute_logits = head.compute_logits if own_head else target.compute_logits
        if self.is_eagle3:
            layer_ids = eagle3_aux_layer_ids(self.model_config.hf_config, self.num_target_layers)
            self.aux = AuxHiddenStates(target, layer_ids, self.max_num_tokens, self.model_config.hidden_size)
        self.model = head

    def prefill(self, model_input: ModelInput, hidden_states: torch.Tensor) -> None:
        """Keep the step's inputs and the target's hidden states: the head's pass over them needs
        the tokens this step samples (``propose``)."""
        self._pending = (model_input, hidden_states)

    def propose(self, rows: np.ndarray, newest: NewestPositions) -> tuple[np.ndarray, torch.Tensor]:
        """After the target's samples are recorded: the head's pass over the step's tokens, then
        ``k - 1`` head steps, for the requests in batch ``rows`` (those that gained tokens), whose
        newest tokens sit at ``newest``. Returns the rows proposed for and their drafts,
        [num_rows, k] int64 on the device."""
        assert self.model is not None and self.cache_engine is not None and self._pending is not None
        model_input, target_hidden = self._pending
        self._pending = None
        input_ids, positions, metadata = unpadded_inputs(model_input)
        num_tokens = input_ids.shape[0]
        next_ids, last_index = self._next_tokens(model_input, input_ids, rows, newest)
        # Even when no request proposes (a step of prompt chunks only): the head's K/V of every
        # scheduled token is written here, and later steps read it.
        if model_input.graph_num_seqs is not None and self.pass_graphs is not None:
            self.pass_ids[:num_tokens].copy_(next_ids)
            out, hidden = self.pass_graphs.replay(num_tokens)
        else:
            with set_forward_context(metadata):
                out, hidden = self._head_pass(next_ids, positions, target_hidden)
        if not len(rows):
            return rows, self.no_proposals()
        tokens = self._greedy(out.index_select(0, last_index))
        hidden = hidden.index_select(0, last_index)
        # Proposals beyond the scratch blocks' requests are dropped (their head K/V is written).
        num_reqs = min(len(rows), self.max_num_proposals)
        rows, tokens, hidden = rows[:num_reqs], tokens[:num_reqs], hidden[:num_reqs]
        drafts = torch.empty((num_reqs, self.num_speculative_tokens), dtype=torch.int64, device=self.device)
        drafts[:, 0] = tokens
        if self.num_proposal_steps:
            drafts[:, 1:] = self._run_proposals(tokens, hidden, rows, newest)
        return rows, drafts

    def _head_pass(
        self, next_ids: torch.Tensor, positions: torch.Tensor, target_hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over a step's tokens: each token's next beside the target's hidden state
        (EAGLE-3: its captured layers, in ``aux``; EAGLE: ``target_hidden``)."""
        assert self.model is not None and self.embed is not None
        num_tokens = next_ids.shape[0]
        hidden = self.aux.buffer[:num_tokens] if self.aux is not None else target_hidden[:num_tokens]
        # Read the captured layers before embedding: a head that shares the target's embeddings
        # runs the hook that captures layer 0 (``AuxHiddenStates``), which would overwrite them.
        hidden = self.model.combine_hidden_states(hidden)
        return self.model(self.embed(next_ids), positions, hidden)

    def _step_pass(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """``StepPass``: the head over ``pass_ids`` and the target graphs' positions and output."""
        assert self.target_graphs is not None
        positions = self.target_graphs.buffers.device_view("positions", batch_size)
        return self._head_pass(self.pass_ids[:batch_size], positions, self.target_graphs.output(batch_size))

    def capture_graphs(self, capture_sizes: list[int], target_graphs: CudaGraphRunner) -> None:
        # The next token of each row of the pass (``_next_tokens``), at a fixed address.
        self.pass_ids = torch.zeros(target_graphs.max_batch_size, dtype=torch.int64, device=self.device)
        super().capture_graphs(capture_sizes, target_graphs)

    def _step(
        self, tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One head step (``ProposalStep``): the draft after ``tokens``, beside the head's previous
        output ``hidden`` (pre-norm), and its own output for the next step."""
        assert self.model is not None
        out, hidden = self.model(self.embed(tokens), positions, hidden)
        return self._greedy(out), hidden

    @property
    def num_proposal_steps(self) -> int:
        """Head steps per proposal loop: the first draft comes from the pass over the step's tokens."""
        return self.num_speculative_tokens - 1

    @property
    def proposal_hidden(self) -> tuple[int, torch.dtype]:
        return self.model_config.hidden_size, self.model_config.dtype

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows] argmax tokens, as target ids."""
        assert self.compute_logits is not None and self.model is not None
        logits = self.compute_logits(hidden)
        return self.model.draft_token_ids(logits) if self.is_eagle3 else logits.argmax(dim=-1)

    def _next_tokens(
        self, model_input: ModelInput, input_ids: torch.Tensor, rows: np.ndarray, newest: NewestPositions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The token after each scheduled one ([num_tokens], device), and for each of ``rows`` the
        index of its position P - 1 (the newest token P's predecessor) in the step ([len(rows)],
        device: P may be a verification's, still on the device).

        Within a request the next token is the next input (prompt tokens, or the drafts being
        verified: at P - 1 and before, the accepted ones); after its last scheduled token it is
        the next prompt token (a chunk mid-prompt: on the host) or, at P - 1 of a request that
        gained tokens, its newest token.
        """
        step_rows, query_start_loc = model_input.req_rows, model_input.req_query_start_loc
        assert step_rows is not None and query_start_loc is not None
        num_reqs = len(step_rows)
        ends = query_start_loc[1:]
        # The position after each request's last scheduled token (the batch's computed tokens are
        # those before the step).
        after_last = self.batch.num_computed_tokens[step_rows] + np.diff(query_start_loc)
        next_ids = torch.roll(input_ids, -1)
        # Prompt chunks that end before the prompt does (few per step): the next prompt token.
        chunks = np.flatnonzero(~np.isin(step_rows, rows))
        if len(chunks):
            host_ids = np.zeros(len(chunks), dtype=np.int64)
            for j, i in enumerate(chunks.tolist()):
                tokens = self.batch.host_token_ids[int(step_rows[i])]
                if tokens is not None and after_last[i] < len(tokens):
                    host_ids[j] = tokens[after_last[i]]
            chunk_ends = to_device(ends[chunks] - 1, self.device)
            next_ids.index_copy_(0, chunk_ends, to_device(host_ids, self.device))
        step_index = np.full(self.batch.max_num_rows, -1, dtype=np.int64)
        step_index[step_rows] = np.arange(num_reqs)
        i = step_index[rows]
        # P - 1 is the last scheduled position, less the drafts a verification rejected.
        last_index = newest.on_device(self.device) + to_device(ends[i] - 1 - after_last[i], self.device)
        newest_ids = self.batch.last_token_ids.index_select(0, to_device(rows, self.device))
        next_ids.index_copy_(0, last_index, newest_ids)
        return next_ids, last_index


def make_drafter(
    config: EngineConfig, attn_backend: type[AttentionBackend], input_batch: InputBatch, max_num_tokens: int
) -> DraftModelRunner | NgramDrafter | None:
    """The worker's drafter for ``speculative_config.method``: a draft model, an EAGLE head, the
    n-gram lookup on the device (with asynchronous scheduling), or None (n-gram drafts from the
    scheduler; no speculation)."""
    spec_config = config.speculative_config
    if spec_config is None or not config.drafts_on_worker:
        return None
    if spec_config.method == "ngram":
        return NgramDrafter(config, input_batch)
    if spec_config.method == "draft_model":
        return DraftModelRunner(config, attn_backend, input_batch)
    return EagleProposer(config, attn_backend, input_batch, max_num_tokens)
